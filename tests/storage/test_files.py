"""The local backend's whole files (`LocalFiles`): a publish leaves the old file or the whole
new one, durably and in order; O_DIRECT refused means the same bytes through the page cache;
dead processes' temporaries go, live ones stay; open files read by offset; removal."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import subprocess
from collections.abc import Sequence

import numpy as np
import pytest

from asynctron.storage.backends import Backend, LocalBackend, backend_for
from asynctron.storage.node_files import _files
from asynctron.storage.node_files._files import DIRECT_CHUNK_BYTES, LocalFiles
from asynctron.storage.node_files._sysio import LocalFileIO
from asynctron.testing import FaultyBackend


def _temporaries(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if ".tmp-" in name)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_the_local_backend_serves_local_paths_with_the_dataset_operations(tmp_path) -> None:
    backend = backend_for(str(tmp_path / "x"))
    assert isinstance(backend, LocalBackend) and isinstance(backend, Backend)
    with pytest.raises(ValueError, match=r"found the scheme 'hdfs'; a URL is never taken for a "
                                         r"local path$"):
        backend_for("hdfs://bucket/x.idx")


# publishing ------------------------------------------------------------------------------------

_PIECES = [b"", b"x", bytes(range(256)) * 16, os.urandom(DIRECT_CHUNK_BYTES + 5000)]


@pytest.mark.parametrize("buffers", [
    [],
    [b""],
    [b"a"],
    [bytes(4096)],  # one whole block
    [b"h" * 128, bytes(4096 - 128)],  # ends on a block boundary
    _PIECES,  # more than one bounce buffer, pieces across its edges
    [memoryview(np.arange(1000, dtype=np.int64))],  # not bytes: cast to bytes
])
def test_publish_buffers_writes_the_buffers_back_to_back(tmp_path, buffers) -> None:
    path = str(tmp_path / "f")
    LocalFiles().publish_buffers(path, buffers)
    assert _read(path) == b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    assert os.listdir(tmp_path) == ["f"]


class _RefusingDirectIO(LocalFileIO):
    """A filesystem that refuses O_DIRECT (EINVAL) when opening a file, or when writing."""

    def __init__(self, refused: str) -> None:
        self.refused = refused
        self.refusals = 0

    def open_new(self, path: str, direct: bool) -> int:
        if self.refused == "open" and direct:
            self.refusals += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().open_new(path, direct)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.refused == "write" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            self.refusals += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return super().pwritev(fd, buffers, offset)


@pytest.mark.parametrize("refused", ["open", "write"])
def test_a_filesystem_refusing_o_direct_gets_the_same_file(tmp_path, refused) -> None:
    file_io = _RefusingDirectIO(refused)
    path = str(tmp_path / "f")
    LocalFiles(file_io).publish_buffers(path, _PIECES)
    assert file_io.refusals == 1  # refused once, then written through the page cache
    assert _read(path) == b"".join(_PIECES)
    assert os.listdir(tmp_path) == ["f"]


def test_short_writes_are_continued(tmp_path) -> None:
    backend = FaultyBackend(max_write_bytes=5000)
    path = str(tmp_path / "f")
    backend.publish_buffers(path, _PIECES)
    assert _read(path) == b"".join(_PIECES) and backend.num_short_writes > 0


@pytest.mark.parametrize(("how", "fault"), [
    ("buffers", "enospc"), ("buffers", "fsync"),
    # these write through the page cache (`file_io` injects no ENOSPC there): the fsync fails
    ("file", "fsync"), ("new file", "fsync"),
])
def test_a_failed_publish_names_the_file_and_leaves_the_old_one(tmp_path, how, fault) -> None:
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"old")
    files = (FaultyBackend(enospc_after_bytes=0) if fault == "enospc"
             else FaultyBackend(fail_fsync=True))
    with pytest.raises(OSError, match=rf"injected by FaultyBackend: '{re.escape(path)}'$"):
        _publish(files, path, how, b"new")
    assert _read(path) == b"old" and _temporaries(str(tmp_path)) == []


def test_a_failing_writer_leaves_the_old_file(tmp_path) -> None:
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"old")

    def write(f) -> None:
        f.write(b"half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match=r"^boom$"):
        LocalFiles().publish_file(path, write)
    assert _read(path) == b"old" and _temporaries(str(tmp_path)) == []


class _Recording(LocalFiles):
    """Records, in order, each data fsync (with what `path` then holds) and each directory
    sync (with what `path` then holds)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.events: list[tuple[str, bytes | None]] = []
        recording = self

        class FileIO(LocalFileIO):
            def fsync(self, fd: int) -> None:
                super().fsync(fd)
                recording.events.append(("fsync", recording._content()))

        super().__init__(FileIO())

    def _content(self) -> bytes | None:
        return _read(self.path) if os.path.exists(self.path) else None

    def sync_dir(self, path: str) -> None:
        super().sync_dir(path)
        self.events.append(("sync dir", self._content()))


@pytest.mark.parametrize("how", ["buffers", "file", "new file"])
@pytest.mark.parametrize("sync_dir", [True, False])
def test_the_file_is_durable_before_its_rename_and_the_rename_then(tmp_path, how,
                                                                    sync_dir) -> None:
    """What a power loss could expose: the data fsynced while `path` is still the old file,
    then (with `sync_dir`) the directory synced once `path` is the new one."""
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"old")
    files = _Recording(path)
    if how == "buffers":
        files.publish_buffers(path, [b"new"], sync_dir=sync_dir)
    elif how == "file":
        files.publish_file(path, lambda f: f.write(b"new"), sync_dir=sync_dir)
    else:
        with files.open_new_file(path) as new:
            new.write(b"new")
            new.publish(sync_dir=sync_dir)
    assert files.events == [("fsync", b"old"), *[("sync dir", b"new")] * sync_dir]


@pytest.mark.parametrize("how", ["buffers", "file", "new file"])
def test_missing_directories_are_made(tmp_path, how) -> None:
    path = str(tmp_path / "a" / "b" / "f")
    files = LocalFiles()
    _publish(files, path, how, b"new")
    assert _read(path) == b"new"


def test_only_dead_processes_temporaries_of_this_host_are_removed(tmp_path) -> None:
    """A publish of a path removes what a killed writer of it on this host left; a live
    writer's temporary, another host's (its pids mean nothing here, even where its name
    starts with ours) and another path's stay."""
    dead = _a_dead_pid()
    path = str(tmp_path / "x.npy")
    host = _files._HOST
    kept = [f"x.npy.tmp-{host}-{os.getpid()}-0000aaaa", f"x.npy.tmp-{host}x-{dead}-0000aaaa",
            f"x.npy.tmp-{host}-12-{dead}-0000aaaa",  # host "<ours>-12"
            f"x.npy.tmp-other-{dead}-0000aaaa", f"y.npy.tmp-{host}-{dead}-0000aaaa"]
    for name in [*kept, f"x.npy.tmp-{host}-{dead}-0000aaaa"]:
        (tmp_path / name).write_bytes(b"partial")
    LocalFiles().publish_file(path, lambda f: f.write(b"whole"))
    assert _temporaries(str(tmp_path)) == sorted(kept)
    assert _read(path) == b"whole"


def _a_dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# a new file, written piece by piece ------------------------------------------------------------

def test_a_new_file_is_invisible_until_published(tmp_path, monkeypatch) -> None:
    """Written past several writeback starts; `path` stays the old file until `publish`."""
    monkeypatch.setattr(_files, "WRITEBACK_BYTES", 3 * 4096)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"old")
    pieces = [os.urandom(5000) for _ in range(20)]
    with LocalFiles().open_new_file(path) as new:
        for piece in pieces:
            assert new.write(piece) == len(piece)
            assert _read(path) == b"old"
        assert new.nbytes == 100_000
        new.publish()
    assert _read(path) == b"".join(pieces) and os.listdir(tmp_path) == ["f"]


def test_a_new_file_closed_unpublished_is_discarded(tmp_path) -> None:
    path = str(tmp_path / "f")
    new = LocalFiles().open_new_file(path)
    new.write(b"partial")
    new.close()
    new.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"^new file .*f: expected it open, found it published "
                                         r"or closed; open another with open_new_file$"):
        new.publish()


# reading and removing --------------------------------------------------------------------------

def test_an_open_file_reads_at_offsets_until_closed(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    with LocalFiles().open_file(str(path)) as f:
        assert f.nbytes == 10
        assert f.pread(3, 2) == b"234"
        assert f.pread(100, 8) == b"89"  # fewer at the end of the file
        assert f.pread(4, 10) == b""
    with pytest.raises(OSError) as closed:
        f.pread(1, 0)
    assert closed.value.errno == errno.EBADF
    f.close()  # again: nothing


def test_only_a_regular_file_opens(tmp_path) -> None:
    files = LocalFiles()
    with pytest.raises(FileNotFoundError):
        files.open_file(str(tmp_path / "missing"))
    with pytest.raises(IsADirectoryError):
        files.open_file(str(tmp_path))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="Not a regular file") as fifo:  # and never waits
        files.open_file(str(tmp_path / "fifo"))
    assert fifo.value.errno == errno.EINVAL


def test_map_file_maps_the_whole_file_read_only(tmp_path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "empty").write_bytes(b"")
    files = LocalFiles()
    mapped = files.map_file(str(tmp_path / "f"))
    assert mapped[:] == b"abc"
    with pytest.raises(TypeError):
        mapped[0] = 1
    assert files.map_file(str(tmp_path / "empty")) == b""


def test_remove_file_takes_a_missing_file(tmp_path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    files = LocalFiles()
    files.remove_file(str(tmp_path / "f"))
    files.remove_file(str(tmp_path / "f"))
    assert os.listdir(tmp_path) == []


def _publish(files: LocalFiles, path: str, how: str, data: bytes) -> None:
    """Publish `data` as `path` one of the three ways: buffers, a write callback, a new file."""
    if how == "buffers":
        files.publish_buffers(path, [data])
    elif how == "file":
        files.publish_file(path, lambda f: f.write(data))
    else:
        with files.open_new_file(path) as new:
            new.write(data)
            new.publish()
