"""The per-bin writer: one file, written batch by batch in file order, each item hashed.

`write` takes every batch that is ready and writes them all in ONE executor call: for each
batch, continue the digest of every item it holds, then pwritev it (looping over short writes,
with O_DIRECT for the aligned part where the file has it). So the loop wakes once per call, not
once per batch, and the loop thread never touches file bytes. Hashing here rather than while
staging keeps it out of the caller's blocking time: staging is then a plain copy, bound by
memory bandwidth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

from asynctron._concurrency import RunBlocking
from asynctron.storage import _sysio
from asynctron.storage._checksum import BodySegments, Checksums
from asynctron.storage._sysio import FileIO


class WriteBatch(Protocol):
    """File bytes [file_offset, +nbytes) ready to write. Its methods are called on the
    executor, once each."""

    @property
    def file_offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def buffers(self) -> Sequence[memoryview]:
        """iovecs covering all the batch's bytes, padding included."""
        ...

    def bodies(self) -> BodySegments:
        """Its items' bytes to digest, in file order."""
        ...


class BinWriter:
    """Writes one bin file; owned by one writer task (not safe for concurrent `write`s).

    Durability: the file's bytes are durable once `finish` returns.
    """

    def __init__(self, fio: FileIO, path: str, nbytes: int, run_blocking: RunBlocking, *,
                 direct_io: bool, checksums: Checksums | None):
        self.path = path
        self.nbytes = nbytes
        self._want_direct = direct_io
        self._direct: _sysio.DirectIO | None = None
        self._fio = fio
        self._run_blocking = run_blocking
        self._checksums = checksums
        self._fd: int | None = None
        self._next_offset = 0

    async def open(self) -> None:
        """Create the file (with O_DIRECT if asked for and the filesystem allows it). Even if
        cancelled, an opened file is owned here, and `aclose` closes it."""
        await self._run_blocking(self._open_file)

    def _open_file(self) -> None:
        """Blocks: the descriptor is recorded in the thread itself, so cancellation cannot
        lose it."""
        fd, direct = _sysio.open_new(self._fio, self.path, self._want_direct)
        self._fd = fd
        self._direct = _sysio.DirectIO(fd, self.path) if direct else None

    async def write(self, batches: Sequence[WriteBatch],
                    on_written: Callable[[WriteBatch], None]) -> None:
        """Write `batches` (consecutive, continuing the file) in one executor call, hashing
        each batch's bodies first; `on_written(batch)` is called on the executor thread after
        each batch.

        Cancellation: the executor call runs to completion; the file is then incomplete and
        the caller discards the whole tmp dir.
        """
        assert self._fd is not None, "open() first"
        for batch in batches:
            assert batch.file_offset == self._next_offset, "batches must be written in order"
            self._next_offset += batch.nbytes
        await self._run_blocking(_write_batches, self._fio, self._fd, self.path, batches,
                                 self._direct, self._checksums, on_written)

    async def finish(self) -> None:
        """fsync and close the file. Raises StorageError if fsync fails."""
        assert self._fd is not None
        assert self._next_offset == self.nbytes, "finish() before every batch was written"
        fd, self._fd = self._fd, None
        try:
            await self._run_blocking(_sysio.fsync, self._fio, fd, self.path)
        finally:
            await self._run_blocking(_sysio.close, self._fio, fd, self.path)

    async def aclose(self) -> None:
        """Close the file if still open (after a failure); never raises StorageError."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            await self._run_blocking(_close_quietly, self._fio, fd)


def _write_batches(fio: FileIO, fd: int, path: str, batches: Sequence[WriteBatch],
                   direct: _sysio.DirectIO | None, checksums: Checksums | None,
                   on_written: Callable[[WriteBatch], None]) -> None:
    """Blocks: per batch, digest its item bytes, then write it at its file offset (a
    one-buffer batch with an unaligned end goes O_DIRECT up to its last full block, then
    buffered)."""
    for batch in batches:
        if checksums is not None:
            checksums.update(batch.bodies())
        buffers = list(batch.buffers())
        calls = [buffers]
        nbytes = batch.nbytes
        head_nbytes = nbytes // _sysio.DIRECT_IO_ALIGN_BYTES * _sysio.DIRECT_IO_ALIGN_BYTES
        if direct is not None and len(buffers) == 1 and 0 < head_nbytes < nbytes:
            calls = [[buffers[0][:head_nbytes]], [buffers[0][head_nbytes:]]]
        written = 0
        for call in calls:
            written += _sysio.write_fully(fio, fd, call, batch.file_offset + written, path,
                                          direct)
        assert written == nbytes, f"wrote {written} bytes of a {nbytes}-byte batch"
        _sysio.start_writeback(fd, batch.file_offset, nbytes)
        on_written(batch)


def _close_quietly(fio: FileIO, fd: int) -> None:
    with contextlib.suppress(OSError):
        fio.close(fd)
