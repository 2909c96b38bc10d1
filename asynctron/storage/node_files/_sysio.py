"""Blocking system calls: file data, directories, renames and small files.

Every function here blocks and must run on the engine's executor (`RunBlocking`), never on the
event loop thread. `FileIO` is the seam for the data path (open, pwritev/preadv, fsync, close)
that fault-injecting fakes (`asynctron.testing`) plug into; directory operations are plain
functions. `OSError` becomes `StorageError` here, in `translate_os_errors`.

Elsewhere in storage, three blocking calls stay beside the code they serve (and run on the
executor too): `_locks.py` opens and `flock`s directories, `_reader.py` maps files
(`_map_file`), and `_commit.py` renames a checkpoint back to its tmp dir when the directory
fsync after its commit fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno as errno_codes
import fcntl
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from asynctron.errors import CorruptCheckpointError, StorageError

#: Linux caps one read/write at 2 GiB - 4 KiB; calls are made no larger than this.
MAX_IO_CALL_BYTES = 0x7FFFF000
#: POSIX guarantees at least this many iovecs per pwritev/preadv call.
MAX_IOVECS = 1024
#: O_DIRECT needs offsets, lengths and memory aligned to the logical block; 4 KiB covers all.
DIRECT_IO_ALIGN_BYTES = 4096


@runtime_checkable
class FileIO(Protocol):
    """Data-path file operations. All block; all raise `OSError` on failure.

    Durability: bytes written with `pwritev` are durable only after `fsync` returns.
    Atomicity: none; a crash may leave any prefix of a file. Commit makes files visible atomically.
    """

    def open_new(self, path: str, direct: bool) -> int:
        """Create `path` exclusively for writing; fails if it exists. With `direct`, bypass
        the page cache (O_DIRECT); fails with EINVAL where the filesystem refuses it."""
        ...

    def open_read(self, path: str) -> int:
        """Open an existing file for reading; never through a symbolic link (ELOOP), and
        without blocking on a FIFO or device (`open_read` below refuses what is not a regular
        file)."""
        ...

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Write the buffers at `offset`; may write fewer bytes than asked (a short write)."""
        ...

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Read into the buffers from `offset`; returns fewer bytes at end of file."""
        ...

    def fsync(self, fd: int) -> None:
        """Make every byte written to `fd` durable."""
        ...

    def close(self, fd: int) -> None:
        """Release `fd`."""
        ...


class LocalFileIO:
    """`FileIO` over the local (POSIX) filesystem."""

    def open_new(self, path: str, direct: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)

    def open_read(self, path: str) -> int:
        return os.open(path, _READ_FLAGS)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)


@contextlib.contextmanager
def translate_os_errors(what: str, path: str) -> Iterator[None]:
    """Re-raise `OSError` as `StorageError` naming `what` was done to `path`."""
    try:
        yield
    except OSError as exc:
        code = errno_codes.errorcode.get(exc.errno or 0, str(exc.errno))
        raise StorageError(
            f"{what} {path!r} failed: {code} ({exc.strerror}); check the storage and retry",
            path=path,
            errno=exc.errno,
        ) from exc


def _advance(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """Drop the first `nbytes` from a buffer list (after a short write or read)."""
    while nbytes and buffers:
        head = buffers[0]
        if nbytes >= head.nbytes:
            nbytes -= head.nbytes
            buffers.pop(0)
        else:
            buffers[0] = head[nbytes:]
            nbytes = 0
    return buffers


def write_fully(fio: FileIO, fd: int, buffers: Sequence[memoryview], offset: int, path: str,
                direct: DirectIO | None = None) -> int:
    """pwritev all of `buffers` at `offset`, looping over short writes. Returns bytes written.
    With `direct`, each call goes through O_DIRECT when it is aligned."""
    pending = [b for b in buffers if b.nbytes]
    total = 0
    with translate_os_errors("writing", path):
        while pending:
            call = pending[:MAX_IOVECS]
            if direct is not None:
                direct.prepare(call, offset + total)
            written = fio.pwritev(fd, call, offset + total)
            if written <= 0:
                raise OSError(errno_codes.EIO, "pwritev wrote no bytes")
            total += written
            pending = _advance(pending, written)
    return total


def read_fully(fio: FileIO, fd: int, buffers: Sequence[memoryview], offset: int, path: str,
               key_at: Callable[[int], str]) -> None:
    """preadv into all of `buffers` from `offset`; a file that ends early is corrupt (the error
    names the item `key_at(file_offset)` says is cut)."""
    pending = [b for b in buffers if b.nbytes]
    done = 0
    with translate_os_errors("reading", path):
        while pending:
            got = fio.preadv(fd, pending[:MAX_IOVECS], offset + done)
            if got == 0:
                key = key_at(offset + done)
                raise CorruptCheckpointError(
                    f"item {key!r} in {path} at offset {offset + done}: expected "
                    f"{sum(b.nbytes for b in pending)} more bytes, found end of file; the "
                    "file was truncated",
                    path=path,
                    key=key,
                    offset=offset + done,
                )
            done += got
            pending = _advance(pending, got)


_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing back [offset, +nbytes) now (Linux `sync_file_range`),
    so the final fsync finds little left to flush. Durability still comes only from fsync;
    where the call is missing or refused, this does nothing."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def open_new(fio: FileIO, path: str, direct: bool) -> tuple[int, bool]:
    """Create `path`; returns (fd, whether O_DIRECT is on). Falls back to buffered I/O where
    the filesystem refuses O_DIRECT (tmpfs)."""
    with translate_os_errors("creating", path):
        return open_new_raw(fio, path, direct)


def open_new_raw(fio: FileIO, path: str, direct: bool) -> tuple[int, bool]:
    """`open_new`, raising the `OSError` itself (for callers that report it as such)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return fio.open_new(path, True), True
        except OSError as exc:
            if exc.errno != errno_codes.EINVAL:
                raise
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return fio.open_new(path, False), False


#: Filesystems whose files live in memory: a buffered write is the storage's only copy.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem `path` is on (`/proc/self/mountinfo`'s entry for its mount
    point), or None where there is no mountinfo."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fstype = "", None
    for line in mounts:
        fields = line.split(" - ", 1)
        mount_point = fields[0].split()[4].replace("\\040", " ")
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if len(fields) == 2 and inside and len(mount_point) >= len(best):
            best, fstype = mount_point, fields[1].split()[0]
    return fstype


def is_direct_io_aligned(buffers: Sequence[memoryview], offset: int) -> bool:
    """Whether O_DIRECT accepts this call: offset, lengths and addresses 4 KiB-aligned."""
    return offset % DIRECT_IO_ALIGN_BYTES == 0 and all(
        buffer.nbytes % DIRECT_IO_ALIGN_BYTES == 0
        and np.frombuffer(buffer, dtype=np.uint8).ctypes.data % DIRECT_IO_ALIGN_BYTES == 0
        for buffer in buffers)


class DirectIO:
    """One file's O_DIRECT switch: on for aligned calls, off for the rest (e.g. a file's
    unaligned tail, a short write's remainder). Linux lets F_SETFL flip O_DIRECT."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd = fd
        self._path = path
        self.enabled = True
        self._refused = False

    def prepare(self, buffers: Sequence[memoryview], offset: int) -> None:
        self._switch(not self._refused and is_direct_io_aligned(buffers, offset))

    def disable(self) -> None:
        """Turn O_DIRECT off for good (the device refused an aligned write: EINVAL)."""
        self._refused = True
        self._switch(False)

    def _switch(self, wanted: bool) -> None:
        if wanted != self.enabled:
            with translate_os_errors("changing O_DIRECT on", self._path):
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL,
                            flags | os.O_DIRECT if wanted else flags & ~os.O_DIRECT)
            self.enabled = wanted


#: Checkpoint files are opened without following a link at the last component (a link could
#: lead out of the checkpoint) and without blocking (a FIFO's open waits for a writer).
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def open_read(fio: FileIO, path: str) -> int:
    """Open a checkpoint file for reading: a regular file, never a link.

    Raises:
        CorruptCheckpointError: `path` is a symbolic link, or not a regular file (names it).
        StorageError: the open failed.
    """
    with translate_os_errors("opening", path):
        try:
            fd = fio.open_read(path)
        except OSError as exc:
            if exc.errno == errno_codes.ELOOP:
                raise _not_regular(path, "a symbolic link") from exc
            raise
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            os.close(fd)
            raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, _kind_of(mode))
    return fd


def _not_regular(path: str, found: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"file {path}: expected a regular file, found {found}; a checkpoint's files are never "
        "followed out of it (copy the file in)", path=path)


def _kind_of(mode: int) -> str:
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a device")


def data_file_size(path: str) -> int:
    """The size of a checkpoint's data file, which must be a regular file, not a link.

    Raises:
        CorruptCheckpointError: `path` is a link or not a regular file (names it).
        StorageError: the stat failed (a missing file too).
    """
    with translate_os_errors("stat of", path):
        status = os.lstat(path)
    if not stat.S_ISREG(status.st_mode):
        raise _not_regular(path, _kind_of(status.st_mode))
    return status.st_size


def fsync(fio: FileIO, fd: int, path: str) -> None:
    with translate_os_errors("fsyncing", path):
        fio.fsync(fd)


def close(fio: FileIO, fd: int, path: str) -> None:
    with translate_os_errors("closing", path):
        fio.close(fd)


def make_dir(path: str) -> None:
    """Create a directory (and its parents); the leaf must not exist."""
    with translate_os_errors("creating directory", path):
        parent = os.path.dirname(path) or "."
        os.makedirs(parent, exist_ok=True)
        os.mkdir(path)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames) durable."""
    with translate_os_errors("fsyncing directory", path):
        fsync_dir_raw(path)


def fsync_dir_raw(path: str) -> None:
    """`fsync_dir`, raising the `OSError` itself (for callers that report it as such)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]


def rename_no_replace(src: str, dst: str) -> None:
    """Rename `src` to `dst`; fails with FileExistsError if `dst` exists, even if it appears
    at the same instant (Linux `renameat2(RENAME_NOREPLACE)`; a check-then-rename where the
    filesystem lacks it). Never overwrites, not even an empty directory."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                      _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno_codes.EINVAL, errno_codes.ENOSYS):  # else: unsupported here
            if code == errno_codes.EEXIST:
                raise FileExistsError(code, "checkpoint exists", dst)
            with translate_os_errors("renaming into", dst):
                raise OSError(code, os.strerror(code), dst)
    if os.path.lexists(dst):
        raise FileExistsError(errno_codes.EEXIST, "checkpoint exists", dst)
    with translate_os_errors("renaming into", dst):
        os.rename(src, dst)


def replace_file(src: str, dst: str) -> None:
    """Atomically replace `dst` by `src` (same directory)."""
    with translate_os_errors("replacing", dst):
        os.replace(src, dst)


def write_small_file(path: str, data: bytes) -> None:
    """Create `path` with `data` and fsync it (manifests, pointers)."""
    with translate_os_errors("writing", path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view.nbytes:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)


def read_small_file(path: str, max_bytes: int) -> bytes:
    """Read a whole small file of a checkpoint (manifest, metadata, pointer): a regular file,
    never a link (`open_read`); larger than `max_bytes` is corrupt (hostile manifests)."""
    fd = open_read(LocalFileIO(), path)
    with translate_os_errors("reading", path), os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CorruptCheckpointError(
            f"file {path}: expected at most {max_bytes} bytes, found more; not an asynctron file",
            path=path,
        )
    return data


def exists(path: str) -> bool:
    return os.path.lexists(path)


def is_file(path: str) -> bool:
    return os.path.isfile(path)


def list_dir(path: str) -> list[str]:
    with translate_os_errors("listing", path):
        return os.listdir(path)


def remove_tree(path: str) -> None:
    """Remove a directory tree; a missing tree is not an error."""
    if not os.path.lexists(path):
        return
    with translate_os_errors("removing", path):
        shutil.rmtree(path)
