"""Tools for testing code that uses asynctron: storage that fails on demand, a loop-lag watchdog.

`FaultyFileIO` is a real `LocalFileIO` that injects ENOSPC/EIO after a byte count, short
writes, and slow or failing fsyncs, so crash and cancellation tests need no monkeypatching.
`LoopWatchdog` measures how late the event loop runs a periodic heartbeat: the worst delay
is the longest the loop was blocked.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from asynctron.storage._sysio import LocalFileIO

__all__ = ["FaultyFileIO", "LoopWatchdog", "LoopWatchdogReport"]


class FaultyFileIO(LocalFileIO):
    """The local filesystem, failing as configured (thread-safe counters).

    Args:
        enospc_after_bytes: writes beyond this many bytes (all files together) fail ENOSPC.
        eio_after_bytes: writes beyond this many bytes fail EIO.
        max_write_bytes: every pwritev writes at most this many bytes (short writes).
        fsync_delay_s: each fsync sleeps this long first.
        open_delay_s: each open sleeps this long first.
        fail_fsync: every fsync fails EIO.
        eio_on_read: every preadv fails EIO.
    """

    def __init__(self, *, enospc_after_bytes: int | None = None,
                 eio_after_bytes: int | None = None, max_write_bytes: int | None = None,
                 fsync_delay_s: float = 0.0, fail_fsync: bool = False,
                 eio_on_read: bool = False, open_delay_s: float = 0.0) -> None:
        self.enospc_after_bytes = enospc_after_bytes
        self.eio_after_bytes = eio_after_bytes
        self.max_write_bytes = max_write_bytes
        self.fsync_delay_s = fsync_delay_s
        self.fail_fsync = fail_fsync
        self.eio_on_read = eio_on_read
        self.open_delay_s = open_delay_s
        self.bytes_written = 0
        self.bytes_read = 0
        self.num_short_writes = 0
        self._lock = threading.Lock()

    def open_new(self, path: str, direct: bool) -> int:
        time.sleep(self.open_delay_s)
        return super().open_new(path, direct)

    def open_read(self, path: str) -> int:
        time.sleep(self.open_delay_s)
        return super().open_read(path)

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        wanted = sum(b.nbytes for b in buffers)
        allowed = wanted if self.max_write_bytes is None else min(wanted, self.max_write_bytes)
        if allowed < wanted and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            allowed = max(4096, allowed // 4096 * 4096)  # O_DIRECT writes whole blocks
        with self._lock:
            for limit, code in ((self.enospc_after_bytes, errno.ENOSPC),
                                (self.eio_after_bytes, errno.EIO)):
                if limit is not None and self.bytes_written + allowed > limit:
                    raise OSError(code, "injected by FaultyFileIO")
            self.bytes_written += allowed
            if allowed < wanted:
                self.num_short_writes += 1
        if allowed < wanted:
            return super().pwritev(fd, _first_bytes(buffers, allowed), offset)
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.eio_on_read:
            raise OSError(errno.EIO, "injected by FaultyFileIO")
        got = super().preadv(fd, buffers, offset)
        with self._lock:
            self.bytes_read += got
        return got

    def fsync(self, fd: int) -> None:
        if self.fsync_delay_s:
            time.sleep(self.fsync_delay_s)
        if self.fail_fsync:
            raise OSError(errno.EIO, "injected by FaultyFileIO")
        super().fsync(fd)


def _first_bytes(buffers: Sequence[memoryview], nbytes: int) -> list[memoryview]:
    out = []
    for buffer in buffers:
        if nbytes <= 0:
            break
        out.append(buffer[:nbytes])
        nbytes -= out[-1].nbytes
    return out


@dataclass(frozen=True, slots=True)
class LoopWatchdogReport:
    """Heartbeat lateness while the watchdog ran."""

    worst_delay_s: float
    mean_delay_s: float
    num_beats: int


class LoopWatchdog:
    """Measures event-loop stalls: `async with LoopWatchdog() as dog: ...; dog.report()`.

    A heartbeat task sleeps `interval_s` over and over; the delay is how much later than asked
    it woke up. The task is owned by the `async with` block.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self._delays: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self._delays.append(max(0.0, time.perf_counter() - start - self.interval_s))

    async def __aenter__(self) -> LoopWatchdog:
        self._task = asyncio.get_running_loop().create_task(self._beat())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise

    def report(self) -> LoopWatchdogReport:
        delays = self._delays or [0.0]
        return LoopWatchdogReport(max(delays), sum(delays) / len(delays), len(self._delays))
