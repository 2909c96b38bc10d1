"""Files a node-local cache shares among the processes of one machine, updated in place.

A cache of objects on this node (datasets' `object_cache`) keeps, per object, a sparse file of
its blocks, a block table every process maps, a lock file, and the directory's shared
counters. These are the file operations it needs, and no more:

- `SharedLock` (and `holding`, for one block): an exclusive `flock` on a lock file, between
  processes (each holds its own; a forked child `reopen`s it);
- `SharedCounters`: a few int64 counters in a file, added to under that file's own lock;
- `read_head`, `file_size`, `replace_empty`, `map_shared`: the block table: read its header
  and size, start it afresh (atomically), map it read-write with its room reserved;
- `BlockFile`: the sparse data file: written block by block, read through a read-only map,
  blocks punched out again;
- `publish_filled`: a whole file of known size, filled in place through a map (a fetch lands
  in the file with no copy) and published atomically and durably.

Room is reserved (`posix_fallocate`) before a file is mapped: touching a mapped page that has
no room kills the process (SIGBUS on a full tmpfs); here it is an `OSError`. Every function
blocks; failures raise `OSError` naming the file, as `LocalFiles` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import mmap
import os
from collections.abc import Callable, Iterator

import numpy as np

from asynctron.storage.node_files import _files
from asynctron.storage.node_files._files import naming
from asynctron.storage.node_files._sysio import fsync_dir_raw

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_fallocate.restype = ctypes.c_int


class SharedLock:
    """An exclusive `flock` on the file `path` (made, with its directories, if missing),
    taken with `with`. It excludes other processes, not other threads of this one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self.reopen()

    def reopen(self) -> None:
        """Open the lock file anew: a forked child does, to hold a lock of its own (the
        parent's descriptor shares the parent's lock)."""
        self.close()
        self._fd = _open_made(self.path)

    def fileno(self) -> int:
        return self._fd

    def __enter__(self) -> SharedLock:
        with naming(self.path):
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc_info: object) -> None:
        with naming(self.path):
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Release the file (and with it the lock); idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


@contextlib.contextmanager
def holding(path: str) -> Iterator[None]:
    """Hold `SharedLock(path)` for the block, then close it."""
    lock = SharedLock(path)
    try:
        with lock:
            yield
    finally:
        lock.close()


class SharedCounters:
    """`count` int64 counters in the file `path` after its 8-byte `magic` (made zero if
    missing), which the processes of this node update under the file's own lock (which, as
    `SharedLock`'s, excludes other processes, not other threads of this one)."""

    def __init__(self, path: str, magic: bytes, count: int) -> None:
        self.path, self.magic, self.count = path, magic, count
        self._nbytes = len(magic) + 8 * count
        self._lock = SharedLock(path)
        try:
            with naming(path), self._lock:
                if os.fstat(self._lock.fileno()).st_size < self._nbytes:
                    os.pwrite(self._lock.fileno(), magic + bytes(8 * count), 0)
        except BaseException:
            self._lock.close()
            raise

    def update(self, change: Callable[[np.ndarray], None]) -> np.ndarray:
        """Apply `change` to the counters in place, under the lock; returns them after."""
        fd = self._lock.fileno()
        with naming(self.path), self._lock:
            raw = bytearray(os.pread(fd, self._nbytes, 0).ljust(self._nbytes, b"\0"))
            words = np.frombuffer(raw, np.int64, self.count, len(self.magic))
            change(words)
            os.pwrite(fd, bytes(raw), 0)
            return words.copy()

    @staticmethod
    def read(path: str, magic: bytes, count: int) -> np.ndarray:
        """The counters of the file `path` (zeros if there is none)."""
        head = read_head(path, len(magic) + 8 * count)
        raw = (head or b"").ljust(len(magic) + 8 * count, b"\0")
        return np.frombuffer(raw, np.int64, count, len(magic)).copy()

    def reopen(self) -> None:
        self._lock.reopen()

    def close(self) -> None:
        self._lock.close()


def read_head(path: str, nbytes: int) -> bytes | None:
    """The first `nbytes` of the file `path` (fewer if it is shorter); None if it is
    missing."""
    try:
        with open(path, "rb") as f:
            return f.read(nbytes)
    except FileNotFoundError:
        return None


def file_size(path: str) -> int | None:
    """The size of the file `path`; None if it is missing."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def replace_empty(path: str, nbytes: int, head: bytes = b"", *, reserve: bool) -> None:
    """Atomically make `path` a file of `nbytes`: `head`, then zeros (holes unless
    `reserve`: then its room is taken now). Processes that have the old file open keep it."""
    temporary = _files.temporary_for(path)
    try:
        with naming(path), open(temporary, "wb") as f:
            f.write(head)
            f.truncate(nbytes)
            if reserve:
                _reserve(f.fileno(), nbytes, path)
        with naming(path):
            os.replace(temporary, path)
    finally:
        _files.remove_quietly(temporary)


def map_shared(path: str, nbytes: int) -> mmap.mmap:
    """The file `path` (of `nbytes`, existing) mapped read-write and shared, its room
    reserved first."""
    with naming(path), open(path, "r+b") as f:
        _reserve(f.fileno(), nbytes, path)
        return mmap.mmap(f.fileno(), nbytes)


class BlockFile:
    """The existing file `path` of `nbytes`, sparse: blocks are written in place (`write`),
    read through a read-only map (`map`), and punched out again (`punch`)."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes
        with naming(path):
            self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def map(self) -> mmap.mmap | bytes:
        """The whole file, mapped read-only (`b""` if it is empty)."""
        if not self.nbytes:
            return b""
        with naming(self.path):
            return mmap.mmap(self._fd, self.nbytes, prot=mmap.PROT_READ)

    def write(self, data: memoryview, offset: int) -> None:
        """Write all of `data` at `offset` (OSError on failure: ENOSPC on a full disk)."""
        with naming(self.path):
            while data.nbytes:
                done = os.pwrite(self._fd, data, offset)
                data, offset = data[done:], offset + done

    def punch(self, offset: int, nbytes: int) -> None:
        """Free bytes `offset : offset + nbytes` (they read as zeros; the size stays)."""
        if _fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset,
                      nbytes) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"punching bytes [{offset}, +{nbytes}) out of {self.path}: "
                          f"{os.strerror(code)}", self.path)

    def close(self) -> None:
        """Release the file (idempotent); a map made stays valid."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def publish_filled(path: str, nbytes: int, fill: Callable[[memoryview], None]) -> None:
    """Publish `path`, a file of `nbytes` that `fill` writes in place (handed the file mapped
    writable): under a temporary name beside it, room reserved first, made durable, renamed
    over `path`, and the rename made durable. On failure nothing is left but `path` as it
    was; `fill`'s own errors pass through as raised, the file's name the others."""
    temporary = _files.temporary_for(path)
    try:
        with open(temporary, "wb+") as out:
            with naming(path):
                out.truncate(nbytes)
                if nbytes:
                    _reserve(out.fileno(), nbytes, path)
                mapped = mmap.mmap(out.fileno(), nbytes) if nbytes else None
            if mapped is not None:
                try:
                    fill(memoryview(mapped))
                    with naming(path):
                        mapped.flush()
                finally:
                    with contextlib.suppress(BufferError):  # a view still held: GC frees it
                        mapped.close()
            with naming(path):
                os.fsync(out.fileno())
        with naming(path):
            os.replace(temporary, path)
            fsync_dir_raw(os.path.dirname(os.path.abspath(path)))
    except BaseException:
        _files.remove_quietly(temporary)
        raise


def _open_made(path: str) -> int:
    """Open `path` read-write, made (with its directories) if missing."""
    with naming(path):
        _files.make_directories(os.path.dirname(os.path.abspath(path)))
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _reserve(fd: int, nbytes: int, path: str) -> None:
    """Give the file `fd` its `nbytes` of room now."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        raise OSError(error.errno, f"no room for the {nbytes} bytes of {path} "
                      f"({os.strerror(error.errno or 0)})", path) from error

