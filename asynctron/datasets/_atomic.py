"""Writing a file whole or not at all: write a temporary name beside it, make it durable, rename.

`write_atomically` writes through the page cache. `write_buffers_atomically` writes given bytes
with `O_DIRECT` where the filesystem takes it: from a small page-aligned bounce buffer straight
to the device, so a large file neither fills the page cache (whose first touch of each page is
the costly part of writing it on a VM) nor waits at `fsync` for a writeback of it. Where
`O_DIRECT` is refused (EINVAL: tmpfs before Linux 6.6, some FUSE filesystems) the same writes go
through the page cache; the result and the guarantee are the same.

After a crash, `path` is either its old file or the whole new one; a rename is made durable
with the directory's `fsync`, which callers renaming several files may do once
(`sync_directory`) for all of them. A temporary is named for its host and process
(`<path>.tmp-<host>-<pid>-<random>`), so the next write of `path` on that host removes what a
killed process left, and nobody else's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import IO

#: O_DIRECT offsets and lengths are multiples of this (the largest usual logical block size).
DIRECT_ALIGNMENT = 4096

#: The bounce buffer: bytes per O_DIRECT write (measured on a virtio disk: 1-4 MiB are equal,
#: larger ones slower).
DIRECT_CHUNK_BYTES = 2 << 20

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: plain writes

_HOST = socket.gethostname()


def sync_directory(directory: str) -> None:
    """Make the renames done in `directory` durable. Blocking call."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        if ours and not _alive(int(ours[1])):
            with contextlib.suppress(FileNotFoundError):  # another process removed it first
                os.remove(os.path.join(directory, found))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def _publishing(path: str, sync_dir: bool) -> Iterator[str]:
    """A temporary path beside `path`, renamed to `path` when the block succeeds (the directory
    then synced if `sync_dir`) and removed when it fails; an OSError without a file name is
    raised again naming `path`. Temporaries of `path` that dead processes of this host left
    are removed first."""
    remove_dead_temporaries(path)
    tmp = f"{path}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
            raise OSError(exc.errno, exc.strerror, path) from exc
        raise
    if sync_dir:
        sync_directory(os.path.dirname(os.path.abspath(path)))


def write_atomically(path: str, write: Callable[[IO[bytes]], object],
                     buffering: int = -1, *, sync_dir: bool = True) -> None:
    """Call `write(f)` on a new file and publish it as `path`, durably: after a crash `path`
    is either the old file or the whole new one (the rename itself durable once the directory
    is synced: here, unless `sync_dir` is False). On any error the temporary file is removed,
    `path` is untouched, and an OSError names `path`. Blocking call."""
    with _publishing(path, sync_dir) as tmp, open(tmp, "wb", buffering=buffering) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_buffers_atomically(path: str, buffers: Sequence[bytes | memoryview], *,
                             sync_dir: bool = True) -> None:
    """Publish the bytes of `buffers`, one after another, as the file `path`, with the
    guarantees of `write_atomically`; written with `O_DIRECT` where the filesystem takes it.
    Blocking call; the GIL is released during each write, so threads may write files at once.

    Memory: one bounce buffer of at most `DIRECT_CHUNK_BYTES`.
    """
    with _publishing(path, sync_dir) as tmp:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags | _O_DIRECT, 0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not _O_DIRECT:
                raise
            fd = os.open(tmp, flags, 0o666)
        try:
            _write_aligned(fd, [memoryview(b).cast("B") for b in buffers])
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_aligned(fd: int, views: list[memoryview]) -> None:
    """Write `views` to `fd` from offset 0 in aligned chunks through a page-aligned bounce
    buffer (the last chunk zero-padded, then the file cut to size). A write refused with
    EINVAL (O_DIRECT and an alignment the device does not take) clears O_DIRECT and is
    retried through the page cache."""
    total = sum(v.nbytes for v in views)
    if total == 0:
        return
    size = min(DIRECT_CHUNK_BYTES, -(-total // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT)
    bounce = memoryview(mmap.mmap(-1, size))  # page-aligned; unmapped once unreferenced
    offset = fill = 0
    for view in views:
        position = 0
        while position < view.nbytes:
            count = min(size - fill, view.nbytes - position)
            bounce[fill:fill + count] = view[position:position + count]
            fill += count
            position += count
            if fill == size:
                _pwrite_all(fd, bounce, offset)
                offset += size
                fill = 0
    if fill:
        padded = -(-fill // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
        bounce[fill:padded] = bytes(padded - fill)
        _pwrite_all(fd, bounce[:padded], offset)
    os.ftruncate(fd, total)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    written = 0
    while written < len(data):
        written += _pwrite(fd, data[written:], offset + written)


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    try:
        return os.pwrite(fd, data, offset)
    except OSError as exc:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if exc.errno != errno.EINVAL or not flags & _O_DIRECT:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        return os.pwrite(fd, data, offset)
