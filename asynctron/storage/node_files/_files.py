"""Whole files on the local filesystem: what datasets publish, map, read and remove.

Publishing: a file is written under a temporary name beside it, made durable, and renamed over
`path`: after a crash `path` is either its old file or the whole new one (the rename itself
durable once the directory is fsynced, which callers publishing several files may do once,
with `sync_dir`). Missing directories of `path` are created first, each made durable in its
parent. `publish_buffers` writes through O_DIRECT where the filesystem takes it, from a small
page-aligned bounce buffer, so a large file neither fills the page cache (whose first touch of
each page is the costly part of writing on a VM) nor waits at `fsync` for its writeback; where
O_DIRECT is refused (tmpfs before Linux 6.6, some FUSE filesystems) the same writes go through
the page cache, with the same result and guarantee. `open_new_file` is the same publish for a
file written piece by piece over a long time (a `.bin` as its corpus is tokenized): it asks
the kernel to start writing back every `WRITEBACK_BYTES` as it goes, so the `fsync` before
the rename finds little left to flush.

A temporary is named for its host and process (`<path>.tmp-<host>-<pid>-<random>`), so the
next publish of `path` on that host removes what a killed process left, and nobody else's.

Data files go through `file_io` (open, pwritev, fsync, close), the seam `asynctron.testing`'s
fault-injecting fakes plug into. Every method blocks. Failures raise `OSError` naming the file
(`FileNotFoundError` for a missing one), as the builtin file calls do.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import socket
import stat
import types
from collections.abc import Callable, Iterator, Sequence
from typing import IO, NoReturn

from asynctron._processes import process_exists
from asynctron.storage.node_files import _sysio
from asynctron.storage.node_files._sysio import FileIO, LocalFileIO

#: The bounce buffer: bytes per O_DIRECT write (measured on a virtio disk: 1-4 MiB are equal,
#: larger ones slower).
DIRECT_CHUNK_BYTES = 2 << 20

#: `open_new_file`'s write buffer (what `IndexedDatasetBuilder` buffered its `.bin` with).
NEW_FILE_BUFFER_BYTES = 16 << 20

#: `open_new_file` starts the writeback of what was written each time this much more is.
WRITEBACK_BYTES = 64 << 20

_HOST = socket.gethostname()


class LocalFiles:
    """The dataset operations of `LocalBackend`: publish whole files atomically, map, read
    and remove them.

    Args:
        file_io: the data path of `publish_file`, `publish_buffers` and `open_new_file` (a
            fault-injecting fake of `asynctron.testing` in tests).
    """

    file_io: FileIO

    def __init__(self, file_io: FileIO | None = None) -> None:
        self.file_io = file_io or LocalFileIO()

    def publish_file(self, path: str, write: Callable[[IO[bytes]], object], *,
                     sync_dir: bool = True) -> None:
        with self._publishing(path, sync_dir) as tmp, open(tmp, "wb") as f:
            write(f)
            f.flush()
            self.file_io.fsync(f.fileno())

    def publish_buffers(self, path: str, buffers: Sequence[bytes | memoryview], *,
                        sync_dir: bool = True) -> None:
        """Memory: one bounce buffer of at most `DIRECT_CHUNK_BYTES`; the GIL is released
        during each write, so threads may publish files at once."""
        with self._publishing(path, sync_dir) as tmp:
            fd, direct = self._open_new(tmp)
            try:
                _write_aligned(self.file_io, fd, tmp, direct,
                               [memoryview(b).cast("B") for b in buffers])
                self.file_io.fsync(fd)
            finally:
                self.file_io.close(fd)

    def sync_dir(self, path: str) -> None:
        _sysio.fsync_dir_raw(path)

    def map_file(self, path: str) -> mmap.mmap | bytes:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def open_file(self, path: str) -> LocalReadableFile:
        return LocalReadableFile(path)

    def open_new_file(self, path: str) -> LocalNewFile:
        return LocalNewFile(self, path)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    @contextlib.contextmanager
    def _publishing(self, path: str, sync_dir: bool) -> Iterator[str]:
        """A temporary path beside `path` (see `temporary_for`), renamed to `path` when the
        block succeeds (the directory then synced if `sync_dir`) and removed when it fails;
        an OSError without a file name is raised again naming `path`."""
        tmp = temporary_for(path)
        try:
            yield tmp
            os.replace(tmp, path)
        except BaseException as exc:
            remove_quietly(tmp)
            raise_naming(exc, path)
        if sync_dir:
            self.sync_dir(_directory_of(path))

    def _open_new(self, tmp: str) -> tuple[int, bool]:
        """Create `tmp`; returns (fd, whether O_DIRECT is on): off where the filesystem
        refuses it (EINVAL)."""
        return _sysio.open_new_raw(self.file_io, tmp, True)


class LocalReadableFile:
    """A regular file opened for positional reads (`Backend.open_file`). Reads from several
    threads at once are safe; so is a fork (the child shares the descriptor).

    `pread(nbytes, offset)` is `os.pread` bound to the descriptor: a C call, no Python frame
    (the per-sample read of `IndexedDataset(mmap=False)`). Up to `nbytes` bytes from `offset`;
    fewer only at the end of the file or beyond the kernel's cap on one read (2 GiB - 4 KiB on
    Linux). After `close` it raises OSError (EBADF); a `pread` taken from the file before
    then must not be called after it (the descriptor's number may name another file by then).

    Raises (constructor):
        FileNotFoundError: no file at `path`.
        IsADirectoryError: `path` is a directory.
        OSError: `path` is not a regular file (EINVAL), or the open failed.
    """

    __slots__ = ("_fd", "nbytes", "path", "pread")

    def __init__(self, path: str) -> None:
        self._fd = -1
        self.pread: Callable[[int, int], bytes] = _closed_pread
        self.path = path
        # O_NONBLOCK: a FIFO's open would wait for a writer (regular files ignore the flag)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            status = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(status.st_mode):
            os.close(fd)
            code = errno.EISDIR if stat.S_ISDIR(status.st_mode) else errno.EINVAL
            what = os.strerror(code) if code == errno.EISDIR else "Not a regular file"
            raise OSError(code, what, path)  # IsADirectoryError for EISDIR
        self._fd = fd
        self.nbytes = status.st_size  # the size when opened
        self.pread = types.MethodType(os.pread, fd)

    def pread_into(self, buffer: memoryview, offset: int) -> int:
        """Blocks: fill `buffer` from `offset` (looping over short reads); returns the bytes
        read, fewer only at the end of the file."""
        view = buffer.cast("B") if buffer.format != "B" else buffer
        done = 0
        while done < view.nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if not got:
                break
            done += got
        return done

    def close(self) -> None:
        """Release the descriptor (again: nothing)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            self.pread = _closed_pread
            os.close(fd)

    def __enter__(self) -> LocalReadableFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._fd < 0 else f"{self.nbytes} bytes"
        return f"<LocalReadableFile {self.path!r}: {state}>"


def _closed_pread(nbytes: int, offset: int) -> bytes:
    raise OSError(errno.EBADF, "read of a closed file")


class LocalNewFile:
    """A file being written under a temporary name until `publish` renames it to `path`
    (`Backend.open_new_file`). One thread at a time.

    Memory: a write buffer of `NEW_FILE_BUFFER_BYTES`.
    """

    def __init__(self, files: LocalFiles, path: str) -> None:
        self.path = path
        self._files = files
        self._tmp = temporary_for(path)
        try:
            self._file = open(self._tmp, "xb", buffering=NEW_FILE_BUFFER_BYTES)  # noqa: SIM115
        except OSError as exc:
            raise_naming(exc, path)
        self._nbytes = 0
        self._written_back = 0
        self._open = True

    @property
    def nbytes(self) -> int:
        """Bytes written so far."""
        return self._nbytes

    def write(self, data: bytes | memoryview) -> int:
        """Blocks: append all of `data`; returns its size in bytes."""
        try:
            written = self._file.write(data)
            self._nbytes += written
            if self._nbytes - self._written_back >= WRITEBACK_BYTES:
                self._file.flush()
                _sysio.start_writeback(self._file.fileno(), self._written_back,
                                       self._nbytes - self._written_back)
                self._written_back = self._nbytes
        except OSError as exc:
            raise_naming(exc, self.path)
        return written

    def publish(self, *, sync_dir: bool = True) -> None:
        """Blocks: make the file durable and rename it to `path` (then sync the directory
        unless `sync_dir` is False). Afterwards `path` is the whole file; on error it is
        untouched and the file is discarded. Either way the file is closed."""
        if not self._open:
            raise ValueError(f"new file {self.path}: expected it open, found it published or "
                             "closed; open another with open_new_file")
        self._open = False
        try:
            self._file.flush()
            self._files.file_io.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException as exc:
            with contextlib.suppress(OSError):  # after a failed flush, closing fails again
                self._file.close()
            remove_quietly(self._tmp)
            raise_naming(exc, self.path)
        if sync_dir:
            self._files.sync_dir(_directory_of(self.path))

    def close(self) -> None:
        """Discard the file unless published; `path` is untouched (again: nothing)."""
        if self._open:
            self._open = False
            with contextlib.suppress(OSError):  # a failed flush of what is discarded anyway
                self._file.close()
            remove_quietly(self._tmp)

    def __enter__(self) -> LocalNewFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_open", False):  # dropped unpublished: discard, as `close` does
            self.close()

    def __repr__(self) -> str:
        state = f"{self._nbytes} bytes written" if self._open else "closed"
        return f"<LocalNewFile {self.path!r}: {state}>"


def remove_dead_temporaries(path: str) -> None:
    """Remove the temporaries of `path` left by processes of this host that are gone (killed
    while writing). Those of a live process, or of another host sharing the directory, stay."""
    directory, name = os.path.split(os.path.abspath(path))
    prefix = f"{name}.tmp-{_HOST}-"
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for found in names:
        # exactly `<pid>-<8 hex>` after the prefix: host "node" is not host "node-12"
        ours = found.startswith(prefix) and re.fullmatch(r"(\d+)-[0-9a-f]{8}", found[len(prefix):])
        if ours and not process_exists(int(ours[1])):
            remove_quietly(os.path.join(directory, found))  # another process may have first


def temporary_for(path: str) -> str:
    """A new temporary name beside `path`, once its missing directories are made and the
    temporaries of `path` that dead processes of this host left are removed."""
    try:
        make_directories(_directory_of(path))
    except OSError as exc:
        raise_naming(exc, path)
    remove_dead_temporaries(path)
    return f"{path}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def make_directories(directory: str) -> None:
    """Create `directory` and its missing parents, each made durable in its parent."""
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            os.mkdir(made)
        _sysio.fsync_dir_raw(os.path.dirname(made))


def _directory_of(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def raise_naming(exc: BaseException, path: str) -> NoReturn:
    """Raise `exc`, an OSError without a file name raised again naming `path`."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
        raise OSError(exc.errno, exc.strerror, path) from exc
    raise exc


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """`raise_naming` for the block: an OSError without a file name raised again naming
    `path`."""
    try:
        yield
    except OSError as error:
        raise_naming(error, path)


def _write_aligned(fio: FileIO, fd: int, path: str, direct: bool,
                   views: list[memoryview]) -> None:
    """Write `views` to `fd` from offset 0 in aligned chunks through a page-aligned bounce
    buffer (the last chunk zero-padded, then the file cut to size). A write refused with
    EINVAL (O_DIRECT and an alignment the device does not take) clears O_DIRECT for the rest
    of the file and is retried through the page cache."""
    total = sum(v.nbytes for v in views)
    if total == 0:
        return
    align = _sysio.DIRECT_IO_ALIGN_BYTES
    size = min(DIRECT_CHUNK_BYTES, -(-total // align) * align)
    bounce = memoryview(mmap.mmap(-1, size))  # page-aligned; unmapped once unreferenced
    switch = _sysio.DirectIO(fd, path) if direct else None
    offset = fill = 0
    for view in views:
        position = 0
        while position < view.nbytes:
            count = min(size - fill, view.nbytes - position)
            bounce[fill:fill + count] = view[position:position + count]
            fill += count
            position += count
            if fill == size:
                _write(fio, fd, bounce, offset, switch)
                offset += size
                fill = 0
    if fill:
        padded = -(-fill // align) * align
        bounce[fill:padded] = bytes(padded - fill)
        _write(fio, fd, bounce[:padded], offset, switch)
    os.ftruncate(fd, total)


def _write(fio: FileIO, fd: int, data: memoryview, offset: int,
           switch: _sysio.DirectIO | None) -> None:
    written = 0
    while written < len(data):
        try:
            written += fio.pwritev(fd, [data[written:]], offset + written)
        except OSError as exc:
            if switch is None or exc.errno != errno.EINVAL or not switch.enabled:
                raise
            switch.disable()
