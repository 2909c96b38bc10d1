"""Tools for testing code that uses asynctron: storage that fails on demand, a loop-lag watchdog.

`FaultyBackend` is a real `LocalBackend` that injects ENOSPC/EIO after a byte count, short
writes, and slow or failing fsyncs, and holds an operation at an exact point until the test
releases it (`hold`), so crash and cancellation tests need neither monkeypatching nor sleeps
timed against injected delays; `GatedObjectClient` holds an object store's calls the same
way. `LoopWatchdog` measures how late the event loop runs a periodic heartbeat: the worst
delay is the longest the loop was blocked (less what its `excluding()` blocks held it for on
purpose, where a program runs its own work on the loop). `ShapingProxy` puts a
`StoreProfile` (one node's bandwidth to a remote store, its first-byte latency, its limit of
requests in flight) between a client and a test store on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from asynctron._concurrency import RunBlocking
from asynctron.storage import Committed, LocalBackend, Retention, SaveArea
from asynctron.storage.backends.local import BinWriter, LocalCheckpoints
from asynctron.storage.format import Checksums
from asynctron.storage.node_files import LocalFileIO
from asynctron.testing._gate import Gate
from asynctron.testing._gated_objects import GatedObjectClient
from asynctron.testing.shaping_proxy import ShapingProxy, ShapingStatistics
from asynctron.testing.store_profile import StoreProfile

if TYPE_CHECKING:
    from asynctron.storage.backends import CheckpointReader

__all__ = ["FaultyBackend", "Gate", "GatedObjectClient", "LoopWatchdog", "LoopWatchdogReport",
           "ShapingProxy", "ShapingStatistics", "StoreProfile"]

HoldPoint = Literal["open", "write", "fsync", "read", "start_save", "commit", "open_reader"]
"""Where `FaultyBackend.hold` stops an operation: a data file's creation (`open`), a write,
an fsync or a read of file bytes (on an executor thread); a save's area being made, its
commit, or a checkpoint being opened for reading, before its lease is taken (on the
loop)."""


class FaultyBackend(LocalBackend):
    """The local filesystem, failing as configured (thread-safe counters), and holding
    operations where asked.

    Args:
        enospc_after_bytes: writes beyond this many bytes (all files together) fail ENOSPC.
        eio_after_bytes: writes beyond this many bytes fail EIO.
        max_write_bytes: every pwritev writes at most this many bytes (short writes).
        fsync_delay_s: each fsync sleeps this long first (a slow disk, for benchmarks of
            overlap; to stop at an fsync, `hold("fsync")`).
        fail_fsync: every fsync fails EIO.
        eio_on_read: every preadv fails EIO.
    """

    def __init__(self, *, enospc_after_bytes: int | None = None,
                 eio_after_bytes: int | None = None, max_write_bytes: int | None = None,
                 fsync_delay_s: float = 0.0, fail_fsync: bool = False,
                 eio_on_read: bool = False) -> None:
        super().__init__(_FaultyFileIO(self))
        self.enospc_after_bytes = enospc_after_bytes
        self.eio_after_bytes = eio_after_bytes
        self.max_write_bytes = max_write_bytes
        self.fsync_delay_s = fsync_delay_s
        self.fail_fsync = fail_fsync
        self.eio_on_read = eio_on_read
        self.bytes_written = 0
        self.bytes_read = 0
        self.num_short_writes = 0
        self._lock = threading.Lock()
        self._gates: list[tuple[HoldPoint, str, Gate]] = []
        self._paths: dict[int, str] = {}
        """Each data file open for writing, by descriptor."""
        self._areas: dict[str, str] = {}
        """The checkpoint path of each save's area a writer was opened in, by location."""

    def hold(self, point: HoldPoint, *, where: str = "") -> Gate:
        """Hold the next operation at `point` on a path containing `where` (a file's for file
        operations, the checkpoint's for `start_save`, `commit` and `open_reader`) at its
        start, until the returned gate is released: `gate = backend.hold("fsync"); ...;
        await gate.reached(); ...; gate.release()`. A file in a save's area also goes by the
        path it will have in the checkpoint (`<checkpoint>/<file>`): an area's own name says
        nothing of it."""
        gate = Gate(point)
        with self._lock:
            self._gates.append((point, where, gate))
        return gate

    def _gate(self, point: HoldPoint, path: str) -> Gate | None:
        with self._lock:
            area, _, name = path.rpartition("/")
            final = self._areas.get(area)
            committed = path if final is None else f"{final}/{name}"
            for held in self._gates:
                if held[0] == point and (held[1] in path or held[1] in committed):
                    self._gates.remove(held)
                    return held[2]
        return None

    def _pass_blocking(self, point: HoldPoint, path: str) -> None:
        gate = self._gate(point, path)
        if gate is not None:
            gate._pass_blocking()

    def checkpoints(self, run_blocking: RunBlocking) -> LocalCheckpoints:
        return _FaultyCheckpoints(self, run_blocking)


class _FaultyCheckpoints(LocalCheckpoints):
    """A `FaultyBackend`'s checkpoints: its saves' starts and commits, and its readers'
    opening, wait at its gates."""

    def __init__(self, backend: FaultyBackend, run_blocking: RunBlocking) -> None:
        super().__init__(backend.file_io, backend._live, run_blocking)
        self._backend = backend

    async def start_save(self, area: SaveArea) -> None:
        gate = self._backend._gate("start_save", area.final_path)
        if gate is not None:
            await gate._pass()
        await super().start_save(area)

    def open_writer(self, area: SaveArea, name: str, nbytes: int, *, direct_io: bool,
                    checksums: Checksums | None) -> BinWriter:
        with self._backend._lock:
            self._backend._areas[area.location] = area.final_path
        return super().open_writer(area, name, nbytes, direct_io=direct_io,
                                   checksums=checksums)

    async def commit(self, area: SaveArea, files: Callable[[], Mapping[str, bytes]], *,
                     retention: Retention | None, seq: int, move_latest: bool) -> Committed:
        gate = self._backend._gate("commit", area.final_path)
        if gate is not None:
            await gate._pass()
        return await super().commit(area, files, retention=retention, seq=seq,
                                    move_latest=move_latest)

    async def open_reader(self, path: str, *, max_files_at_once: int) -> CheckpointReader:
        gate = self._backend._gate("open_reader", path)
        if gate is not None:
            await gate._pass()
        return await super().open_reader(path, max_files_at_once=max_files_at_once)


class _FaultyFileIO(LocalFileIO):
    """The data path of a `FaultyBackend`, failing as the backend's settings say."""

    def __init__(self, backend: FaultyBackend) -> None:
        self._backend = backend

    def open_new(self, path: str, direct: bool) -> int:
        backend = self._backend
        backend._pass_blocking("open", path)
        fd = super().open_new(path, direct)
        with backend._lock:
            backend._paths[fd] = path
        return fd

    def open_read(self, path: str) -> int:
        fd = super().open_read(path)
        with self._backend._lock:
            self._backend._paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        with self._backend._lock:
            self._backend._paths.pop(fd, None)
        super().close(fd)

    def _path(self, fd: int) -> str:
        with self._backend._lock:
            return self._backend._paths.get(fd, "")

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        backend = self._backend
        backend._pass_blocking("write", self._path(fd))
        wanted = sum(b.nbytes for b in buffers)
        allowed = (wanted if backend.max_write_bytes is None
                   else min(wanted, backend.max_write_bytes))
        if allowed < wanted and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            allowed = max(4096, allowed // 4096 * 4096)  # O_DIRECT writes whole blocks
        with backend._lock:
            for limit, code in ((backend.enospc_after_bytes, errno.ENOSPC),
                                (backend.eio_after_bytes, errno.EIO)):
                if limit is not None and backend.bytes_written + allowed > limit:
                    raise OSError(code, "injected by FaultyBackend")
            backend.bytes_written += allowed
            if allowed < wanted:
                backend.num_short_writes += 1
        if allowed < wanted:
            return super().pwritev(fd, _first_bytes(buffers, allowed), offset)
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        backend = self._backend
        backend._pass_blocking("read", self._path(fd))
        if backend.eio_on_read:
            raise OSError(errno.EIO, "injected by FaultyBackend")
        got = super().preadv(fd, buffers, offset)
        with backend._lock:
            backend.bytes_read += got
        return got

    def fsync(self, fd: int) -> None:
        backend = self._backend
        backend._pass_blocking("fsync", self._path(fd))
        if backend.fsync_delay_s:
            time.sleep(backend.fsync_delay_s)
        if backend.fail_fsync:
            raise OSError(errno.EIO, "injected by FaultyBackend")
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
    """Net of the blocks run under `LoopWatchdog.excluding()` (all of it if none were)."""
    mean_delay_s: float
    num_beats: int
    excluded_s: float = 0.0
    """The time spent in `excluding()` blocks, left out of the delays."""


class LoopWatchdog:
    """Measures event-loop stalls: `async with LoopWatchdog() as dog: ...; dog.report()`.

    A heartbeat task sleeps `interval_s` over and over; the delay is how much later than asked
    it woke up, less the time spent meanwhile in `excluding()` blocks. The task is owned by the
    `async with` block.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self._delays: list[float] = []
        self._excluded_s = 0.0
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def excluding(self) -> Iterator[None]:
        """Leave the block's duration out of the delays: for work a program runs on the loop
        on purpose (an async trainer's forward, backward and optimizer step), so the delays
        measure the rest. The block must not await: the loop must not turn inside it."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._excluded_s += time.perf_counter() - started

    async def _beat(self) -> None:
        while True:
            start, excluded = time.perf_counter(), self._excluded_s
            await asyncio.sleep(self.interval_s)
            late = time.perf_counter() - start - self.interval_s
            self._delays.append(max(0.0, late - (self._excluded_s - excluded)))

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
        return LoopWatchdogReport(max(delays), sum(delays) / len(delays), len(self._delays),
                                  self._excluded_s)
