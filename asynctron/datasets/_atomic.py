"""Writing a file whole or not at all: write a temporary name beside it, make it durable, rename.

`write_atomically` writes through the page cache. `write_buffers_atomically` writes given bytes
with `O_DIRECT` where the filesystem takes it: from a small page-aligned bounce buffer straight
to the device, so a large file neither fills the page cache (whose first touch of each page is
the costly part of writing it on a VM) nor waits at `fsync` for a writeback of it. Where
`O_DIRECT` is refused (EINVAL: tmpfs before Linux 6.6, some FUSE filesystems) the same writes go
through the page cache; the result and the guarantee are the same.

After a crash, `path` is either its old file or the whole new one; a rename is made durable
with the directory's `fsync`, which callers renaming several files may do once
(`sync_directory`) for all of them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
from collections.abc import Callable, Sequence
from typing import IO

#: O_DIRECT offsets and lengths are multiples of this (the largest usual logical block size).
DIRECT_ALIGNMENT = 4096

#: The bounce buffer: bytes per O_DIRECT write (measured on a virtio disk: 1-4 MiB are equal,
#: larger ones slower).
DIRECT_CHUNK_BYTES = 2 << 20

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: plain writes


def _temporary(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def sync_directory(directory: str) -> None:
    """Make the renames done in `directory` durable. Blocking call."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, write: Callable[[IO[bytes]], object],
                     buffering: int = -1, *, sync_dir: bool = True) -> None:
    """Call `write(f)` on a new file and publish it as `path`, durably: after a crash `path`
    is either the old file or the whole new one (the rename itself durable only once the
    directory is synced: here unless `sync_dir` is False). On any error the temporary file is
    removed and `path` is untouched. Blocking call."""
    tmp = _temporary(path)
    try:
        with open(tmp, "wb", buffering=buffering) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    if sync_dir:
        sync_directory(os.path.dirname(os.path.abspath(path)))


def write_buffers_atomically(path: str, buffers: Sequence[bytes | memoryview], *,
                             sync_dir: bool = True) -> None:
    """Publish the bytes of `buffers`, one after another, as the file `path`, with the
    guarantees of `write_atomically`; written with `O_DIRECT` where the filesystem takes it.
    Blocking call; the GIL is released during each write, so threads may write files at once.

    Memory: one bounce buffer of at most `DIRECT_CHUNK_BYTES`.
    """
    tmp = _temporary(path)
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT,
                         0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not _O_DIRECT:
                raise
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            _write_aligned(fd, [memoryview(b).cast("B") for b in buffers])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    if sync_dir:
        sync_directory(os.path.dirname(os.path.abspath(path)))


def _write_aligned(fd: int, views: list[memoryview]) -> None:
    """Write `views` to `fd` from offset 0 in aligned chunks through a page-aligned bounce
    buffer (the last chunk zero-padded, then the file cut to size). A write refused with
    EINVAL (O_DIRECT and an alignment the device does not take) clears O_DIRECT and is
    retried through the page cache."""
    total = sum(v.nbytes for v in views)
    if total == 0:
        return
    size = min(DIRECT_CHUNK_BYTES, -(-total // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT)
    with mmap.mmap(-1, size) as bounce:
        offset = fill = 0

        def flush(length: int) -> None:
            nonlocal offset, fill
            chunk = memoryview(bounce)[:length]
            try:
                written = 0
                while written < length:
                    written += _pwrite(fd, chunk[written:], offset + written)
            finally:
                chunk.release()
            offset += length
            fill = 0

        for view in views:
            position = 0
            while position < view.nbytes:
                count = min(size - fill, view.nbytes - position)
                bounce[fill:fill + count] = view[position:position + count]
                fill += count
                position += count
                if fill == size:
                    flush(size)
        if fill:
            padded = -(-fill // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
            bounce[fill:padded] = bytes(padded - fill)
            flush(padded)
    os.ftruncate(fd, total)


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    try:
        return os.pwrite(fd, data, offset)
    except OSError as exc:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if exc.errno != errno.EINVAL or not flags & _O_DIRECT:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        return os.pwrite(fd, data, offset)
