"""The index cache: entries load only when complete, `must_exist` loads with no collective;
saves publish through the storage backend, the description last; loads map and check."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Sequence
from typing import IO

import numpy as np
import pytest
import torch.distributed as dist

from asynctron.datasets.formats._cache import CacheEntry, describe, load_or_build
from asynctron.errors import CorruptDatasetError
from asynctron.storage.backends import LocalBackend
from asynctron.testing import FaultyBackend

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


# saving: the bytes np.save writes, through the backend, description last ------------------------

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


def test_the_cache_directory_is_made(tmp_path) -> None:
    entry = _entry(str(tmp_path / "a" / "cache"))
    load_or_build(entry, LAYOUT, _builds([]))
    assert entry.complete()


class _Recording(LocalBackend):
    """The local backend, recording each publish (with its `sync_dir`) and directory sync as
    it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str, bool | None]] = []
        self._lock = threading.Lock()

    def _record(self, event: str, path: str, sync_dir: bool | None = None) -> None:
        with self._lock:
            self.events.append((event, os.path.basename(path), sync_dir))

    def publish_buffers(self, path: str, buffers: Sequence[bytes | memoryview], *,
                        sync_dir: bool = True) -> None:
        super().publish_buffers(path, buffers, sync_dir=sync_dir)
        self._record("published", path, sync_dir)

    def publish_file(self, path: str, write: Callable[[IO[bytes]], object], *,
                     sync_dir: bool = True) -> None:
        super().publish_file(path, write, sync_dir=sync_dir)
        self._record("published", path, sync_dir)

    def sync_dir(self, path: str) -> None:
        super().sync_dir(path)
        self._record("synced", path)


def test_the_description_is_published_after_every_array_is_durable(
        tmp_path, serve_local_paths) -> None:
    """The order a power loss could expose: every array published (each durable before its
    rename: `tests/storage/test_files.py`), their renames made durable by one directory sync,
    then the description published and its rename synced."""
    backend = _Recording()
    serve_local_paths(backend)
    entry = _entry(str(tmp_path / "cache"))
    entry.save(_arrays())
    arrays = sorted(os.path.basename(entry.path(f"{n}.npy")) for n in LAYOUT)
    description = os.path.basename(entry.path("description.txt"))
    events = backend.events
    assert sorted(events[:2]) == [("published", name, False) for name in arrays]
    assert events[2] == ("synced", "cache", None)
    assert events[-1] == ("published", description, True)


def test_a_failed_write_names_the_file_and_leaves_nothing(tmp_path, serve_local_paths) -> None:
    serve_local_paths(FaultyBackend(enospc_after_bytes=0))
    entry = _entry(str(tmp_path))
    path = entry.path("a.npy")
    with pytest.raises(OSError, match=rf"injected by FaultyBackend: '{re.escape(path)}'$"):
        entry.save(_arrays())
    assert os.listdir(tmp_path) == [] and not entry.complete()


def test_a_url_no_backend_serves_is_refused_not_taken_for_a_local_path(tmp_path,
                                                                       monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    entry = _entry("hdfs://bucket/cache")
    with pytest.raises(ValueError, match=r"found the scheme 'hdfs'; a URL is never taken for a "
                                         r"local path$"):
        load_or_build(entry, LAYOUT, _builds([]))
    assert os.listdir(tmp_path) == []


# loading: a map of each array, checked ---------------------------------------------------------

@pytest.mark.parametrize("array", [
    np.arange(1000, dtype=np.int32),
    np.asfortranarray(np.arange(600, dtype=np.int64).reshape(300, 2)),
    np.empty((0, 2), np.int64),
])
@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_loaded_arrays_are_read_only_maps_equal_to_np_load(tmp_path, array, version) -> None:
    entry = _entry(str(tmp_path))
    layout = {"x": ((array.dtype,), array.ndim, None)}
    with open(entry.path("x.npy"), "wb") as f:
        np.lib.format.write_array(f, array, version=version)
    loaded = entry.load(layout)["x"]
    assert type(loaded) is np.ndarray and not loaded.flags.writeable
    expected = np.load(entry.path("x.npy"))
    assert loaded.dtype == expected.dtype and np.array_equal(loaded, expected)
    assert loaded.flags.f_contiguous == expected.flags.f_contiguous


@pytest.mark.parametrize(("content", "found"), [
    (b"", r"EOF: reading magic string, expected 8 bytes got 0"),
    (b"not a .npy file", r"the magic string is not correct; expected b'\\x93NUMPY', got "),
    ("truncated", r"a file of 228 bytes, where its header's \(1000,\) int32 array ends at "
                  r"byte 4128"),
    ("objects", r"an object array \(it would need pickle\)"),
])
def test_a_cached_file_that_is_no_npy_is_named(tmp_path, content, found) -> None:
    entry = _entry(str(tmp_path))
    path = entry.path("a.npy")
    if content == "truncated":
        np.save(path, np.arange(1000, dtype=np.int32))
        os.truncate(path, 228)
    elif content == "objects":
        np.save(path, np.array([1, None], dtype=object), allow_pickle=True)
    else:
        with open(path, "wb") as f:
            f.write(content)
    with pytest.raises(CorruptDatasetError, match=(
            rf"^cached index {re.escape(path)}: expected a readable \.npy, found {found}.*; "
            r"delete the file to rebuild it$")):
        entry.load({"a": LAYOUT["a"]})


# SIGKILL in the middle of a save ---------------------------------------------------------------

KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from asynctron.datasets.formats._cache import CacheEntry
    from asynctron.storage.backends import LocalBackend, register_backend
    from asynctron.storage.node_files._sysio import LocalFileIO

    directory, digest, description, kill_at = sys.argv[1:5]

    class KilledAtAnFsync(LocalFileIO):  # SIGKILL after data fsync number `kill_at` (1-based)
        fsyncs = 0

        def fsync(self, fd):
            super().fsync(fd)
            KilledAtAnFsync.fsyncs += 1
            if KilledAtAnFsync.fsyncs == int(kill_at):
                os.kill(os.getpid(), signal.SIGKILL)

    register_backend("file", lambda: LocalBackend(KilledAtAnFsync()))
    rng = np.random.default_rng(int(kill_at))
    CacheEntry(directory, digest, "Test", "train", description).save(
        {"a": rng.integers(0, 100, 1000, dtype=np.int32),
         "b": rng.integers(0, 100, (300, 2), dtype=np.int64)})
""")


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [1, 2, 3, 4])
def test_an_entry_killed_while_saving_is_rebuilt_not_loaded(tmp_path, kill_at) -> None:
    """Killed once the 1st or 2nd array, or the description (3rd), is durable under its
    temporary name but not yet renamed, or, as a control, never (4th): only the finished save
    loads; the others are rebuilt, the arrays the killed save left (other values than the
    build's) are replaced, and so are its temporaries."""
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
