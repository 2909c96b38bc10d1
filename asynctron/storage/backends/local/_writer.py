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

from asynctron._concurrency import RunBlocking
from asynctron.storage.backends._write_batch import WriteBatch
from asynctron.storage.format import Checksums
from asynctron.storage.node_files import _sysio
from asynctron.storage.node_files._sysio import FileIO


class BinWriter:
    """Writes one bin file; owned by one writer task (not safe for concurrent `write`s).

    Durability: the file's bytes are durable once the `write` that completes it returns: that
    call also fsyncs and closes the file (one executor call, one loop turn, fewer for an async
    trainer to give).
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

    @property
    def done(self) -> bool:
        """Whether the file is complete, durable and closed."""
        return self._fd is None and self._next_offset == self.nbytes

    async def write(self, batches: Sequence[WriteBatch],
                    on_written: Callable[[WriteBatch], None]) -> None:
        """Write `batches` (consecutive, continuing the file) in one executor call, digesting
        each batch's bodies first; `on_written(batch)` is called on the executor thread after
        each batch. When they complete the file (an empty file: with no batches), the same call
        fsyncs and closes it.

        Raises:
            StorageError: a write, fsync or close failed.

        Cancellation: the executor call runs to completion; the file is then incomplete and
        the caller discards the whole tmp dir.
        """
        assert self._fd is not None, "open() first"
        for batch in batches:
            assert batch.file_offset == self._next_offset, "batches must be written in order"
            self._next_offset += batch.nbytes
        complete = self._next_offset == self.nbytes
        fd = self._fd
        if complete:
            self._fd = None  # from here on, the call below closes it
        await self._run_blocking(_write_batches, self._fio, fd, self.path, batches,
                                 self._direct, self._checksums, on_written, complete)

    async def aclose(self) -> None:
        """Close the file if still open (after a failure); never raises StorageError."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            await self._run_blocking(_close_quietly, self._fio, fd)


def _write_batches(fio: FileIO, fd: int, path: str, batches: Sequence[WriteBatch],
                   direct: _sysio.DirectIO | None, checksums: Checksums | None,
                   on_written: Callable[[WriteBatch], None], complete: bool) -> None:
    """Blocks: per batch, digest its item bytes, then write it at its file offset (a
    one-buffer batch with an unaligned end goes O_DIRECT up to its last full block, then
    buffered); with `complete`, then fsync and close the file (closed even if that fails)."""
    try:
        _write_all(fio, fd, path, batches, direct, checksums, on_written)
        if complete:
            _sysio.fsync(fio, fd, path)
    finally:
        if complete:
            _sysio.close(fio, fd, path)


def _write_all(fio: FileIO, fd: int, path: str, batches: Sequence[WriteBatch],
               direct: _sysio.DirectIO | None, checksums: Checksums | None,
               on_written: Callable[[WriteBatch], None]) -> None:
    for batch in batches:
        if checksums is not None:
            checksums.update(batch.bodies())
        buffers = list(batch.buffers())
        calls = [buffers]
        nbytes = batch.nbytes
        head_bytes = nbytes // _sysio.DIRECT_IO_ALIGN_BYTES * _sysio.DIRECT_IO_ALIGN_BYTES
        if direct is not None and len(buffers) == 1 and 0 < head_bytes < nbytes:
            calls = [[buffers[0][:head_bytes]], [buffers[0][head_bytes:]]]
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
