"""The index cache: entries load only when complete, `must_exist` loads with no collective."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch.distributed as dist

from asynctron.datasets import _atomic
from asynctron.datasets._cache import CacheEntry, describe, load_or_build

LAYOUT = {"a": ((np.int32,), 1, None), "b": ((np.int64,), 2, 2)}


def _arrays() -> dict[str, np.ndarray]:
    return {"a": np.arange(1000, dtype=np.int32),
            "b": np.arange(600, dtype=np.int64).reshape(300, 2)}


def _entry(directory: str) -> CacheEntry:
    description, digest = describe({"class": "Test", "n": 1000})
    return CacheEntry(directory, digest, "Test", "train", description)


def _builds(built: list[int]):
    def build() -> dict[str, np.ndarray]:
        built.append(1)
        return _arrays()
    return build


def _as_rank_one_of_two(monkeypatch) -> None:
    """torch.distributed seen as initialized, this process rank 1 of 2; a barrier fails."""
    def barrier() -> None:
        raise AssertionError("a barrier was entered")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "barrier", barrier)


def test_built_once_then_loaded(tmp_path) -> None:
    entry, built = _entry(str(tmp_path / "cache")), []
    first = load_or_build(entry, LAYOUT, _builds(built))
    second = load_or_build(entry, LAYOUT, _builds(built))
    assert built == [1]
    assert all(np.array_equal(first[k], second[k]) for k in LAYOUT)
    assert all(np.array_equal(np.load(entry.path(f"{k}.npy")), v) for k, v in _arrays().items())


def test_no_path_enters_a_collective(tmp_path, monkeypatch) -> None:
    """The builder orders the ranks; load_or_build never waits on one (a rank finding the
    entry missing builds it itself)."""
    entry, built = _entry(str(tmp_path / "cache")), []
    _as_rank_one_of_two(monkeypatch)
    load_or_build(entry, LAYOUT, _builds(built))
    load_or_build(entry, LAYOUT, _builds(built))
    arrays = load_or_build(entry, LAYOUT, _builds(built), must_exist=True)
    assert built == [1]
    assert all(np.array_equal(arrays[k], v) for k, v in _arrays().items())


@pytest.mark.parametrize("damage", ["missing", "no description", "other description"])
def test_must_exist_refuses_an_incomplete_entry_naming_its_description(
        tmp_path, monkeypatch, damage) -> None:
    entry, built = _entry(str(tmp_path / "cache")), []
    if damage != "missing":
        load_or_build(entry, LAYOUT, _builds(built))
        if damage == "no description":
            os.remove(entry.path("description.txt"))
        else:
            with open(entry.path("description.txt"), "w") as f:
                f.write("{}")
    _as_rank_one_of_two(monkeypatch)
    path = entry.path("description.txt")
    with pytest.raises(FileNotFoundError, match=(
            rf"^cached indices {re.escape(path)}: expected the complete cache entry this config "
            r"describes \(fast_cache_load\), found none; build the cache first with `asynctron "
            r"prepare-cache CONFIG`, or with a run without fast_cache_load$")):
        load_or_build(entry, LAYOUT, _builds(built), must_exist=True)
    assert len(built) == (damage != "missing")  # never built by must_exist


# saving: the bytes np.save writes, O_DIRECT or not, description last ---------------------------

@pytest.mark.parametrize("array", [
    np.arange(1000, dtype=np.int32),
    np.arange(3_000_001, dtype=np.int64).reshape(-1, 1)[:3_000_000].reshape(-1, 2),  # > a chunk
    np.arange(10, dtype=np.uint32)[::2],  # not contiguous
    np.empty((0, 2), np.int32),
    np.ones(4096 - 128, np.uint8),  # header and data end on a block boundary
])
def test_saved_files_are_the_bytes_np_save_writes(tmp_path, array) -> None:
    entry = _entry(str(tmp_path))
    entry.save({"x": array})
    expected = io.BytesIO()
    np.save(expected, array)
    with open(entry.path("x.npy"), "rb") as f:
        assert f.read() == expected.getvalue()
    assert entry.complete()
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(entry.path(n))
                                            for n in ("description.txt", "x.npy")]


@pytest.mark.parametrize("refused", ["open", "write"])
def test_a_filesystem_refusing_o_direct_gets_the_same_files(tmp_path, monkeypatch,
                                                            refused) -> None:
    real_open, real_pwrite, refusals = os.open, os.pwrite, []

    def open_(path, flags, *args):
        if refused == "open" and flags & os.O_DIRECT:
            refusals.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def pwrite(fd, data, offset):
        if refused == "write" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refusals.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "pwrite", pwrite)
    entry = _entry(str(tmp_path))
    arrays = _arrays()
    entry.save(arrays)
    assert len(refusals) == len(arrays)
    for name, array in arrays.items():
        assert np.array_equal(np.load(entry.path(f"{name}.npy")), array)


def test_the_description_is_published_after_every_array_is_durable(tmp_path,
                                                                    monkeypatch) -> None:
    """The order a power loss could expose: each array fsynced before its rename, the renames
    made durable (directory fsync) before the description's rename, and that one synced too."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, lock = os.fsync, os.replace, threading.Lock()

    def fsync(fd: int) -> None:
        real_fsync(fd)
        with lock:
            events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))

    def replace(src: str, dst: str) -> None:
        real_replace(src, dst)
        with lock:
            events.append(("rename", os.path.basename(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    entry = _entry(str(tmp_path / "cache"))
    entry.save(_arrays())
    names = [os.path.basename(entry.path(f"{n}.npy")) for n in LAYOUT]
    description = os.path.basename(entry.path("description.txt"))
    renames = [name for kind, name in events if kind == "rename"]
    assert sorted(renames[:-1]) == sorted(names) and renames[-1] == description
    for name in names:
        synced = next(i for i, (kind, n) in enumerate(events)
                      if kind == "fsync" and n.startswith(name + ".tmp-"))
        assert synced < events.index(("rename", name))
    directory_synced = events.index(("fsync", "cache"))
    assert max(events.index(("rename", n)) for n in names) < directory_synced
    assert directory_synced < events.index(("rename", description))
    assert events[-1] == ("fsync", "cache")


# SIGKILL in the middle of a save ---------------------------------------------------------------

KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from asynctron.datasets._cache import CacheEntry

    directory, digest, description, kill_at = sys.argv[1:5]
    real_replace, renames = os.replace, []

    def replace(src, dst):  # SIGKILL before the rename number `kill_at` (1-based)
        renames.append(dst)
        if len(renames) == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = replace
    rng = np.random.default_rng(int(kill_at))
    CacheEntry(directory, digest, "Test", "train", description).save(
        {"a": rng.integers(0, 100, 1000, dtype=np.int32),
         "b": rng.integers(0, 100, (300, 2), dtype=np.int64)})
""")


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4])
def test_an_entry_killed_while_saving_is_rebuilt_not_loaded(tmp_path, kill_at) -> None:
    """Killed before the 1st or 2nd array's rename, before the description's (3rd) or, as a
    control, never (4th): only the finished save loads; the others are rebuilt, the arrays
    the killed save left (other values than the build's) are replaced, and so are its
    temporaries."""
    entry = _entry(str(tmp_path / "cache"))
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, entry.directory,
                            entry.description_hash, entry.description, str(kill_at)],
                           capture_output=True, text=True, timeout=120)
    finished = kill_at > len(LAYOUT) + 1
    assert child.returncode == (0 if finished else -signal.SIGKILL), child.stderr
    assert entry.complete() == finished
    assert bool(_temporaries(entry.directory)) != finished
    built: list[int] = []
    arrays = load_or_build(entry, LAYOUT, _builds(built))
    assert built == ([] if finished else [1])
    assert _temporaries(entry.directory) == []
    if not finished:
        expected = _arrays()
        for name in LAYOUT:
            assert np.array_equal(arrays[name], expected[name])
            assert np.array_equal(np.load(entry.path(f"{name}.npy")), expected[name])


def _temporaries(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if ".tmp-" in name)


def test_only_dead_processes_temporaries_of_this_host_are_removed(tmp_path) -> None:
    """A write of a path removes what a killed writer of it on this host left; a live
    writer's temporary, another host's (its pids mean nothing here, even where its name
    starts with ours) and another path's stay."""
    dead = _a_dead_pid()
    path = str(tmp_path / "x.npy")
    host = _atomic._HOST
    kept = [f"x.npy.tmp-{host}-{os.getpid()}-0000aaaa", f"x.npy.tmp-{host}x-{dead}-0000aaaa",
            f"x.npy.tmp-{host}-12-{dead}-0000aaaa",  # host "<ours>-12"
            f"x.npy.tmp-other-{dead}-0000aaaa", f"y.npy.tmp-{host}-{dead}-0000aaaa"]
    for name in [*kept, f"x.npy.tmp-{host}-{dead}-0000aaaa"]:
        (tmp_path / name).write_bytes(b"partial")
    _atomic.write_atomically(path, lambda f: f.write(b"whole"))
    assert _temporaries(str(tmp_path)) == sorted(kept)
    with open(path, "rb") as f:
        assert f.read() == b"whole"


def _a_dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_failed_write_names_the_file_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    entry = _entry(str(tmp_path))
    path = entry.path("a.npy")
    with pytest.raises(OSError, match=rf"No space left on device: '{re.escape(path)}'"):
        entry.save(_arrays())
    assert os.listdir(tmp_path) == [] and not entry.complete()
