"""`Runtime`: the asynctron engine the DCP plugins run on, one per option set in the process.

DCP calls its storage plugins synchronously, from the trainer's thread (`dcp.save`,
`dcp.load`) or from DCP's own save thread (`dcp.async_save`). A runtime is an `Engine` bound to
a uvloop loop on a daemon thread of its own (`LoopThread`, as `BackgroundEngine`'s): plugin
calls hand it coroutines and wait on (or return) their futures; the loop never blocks, and
every file syscall, copy and CUDA wait runs on the engine's bounded executor.

Runtimes are process-wide and shared: every `StorageWriter`, `StorageReader` and `AsyncStager`
built with the same options uses the same one (so the same budgets), made on first use and
closed when the interpreter exits. Across ranks, DCP does the coordination (its own collectives
on the default or given process group); a runtime's engine never joins a process group.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import torch

from asynctron._budget import ByteBudget
from asynctron._loop_thread import LoopThread
from asynctron.engine import Engine, EngineConfig
from asynctron.engine._coordinator import SoloCollectives
from asynctron.engine._slabs import SLAB_CACHE, SlabPool
from asynctron.engine._staging import CopyStreams
from asynctron.storage import FileIO, LocalFileIO

T = TypeVar("T")

#: Engine options the plugins take; the others (`keep_last`, `job`, `coordination_timeout_s`)
#: belong to asynctron's own save protocol, which DCP's replaces.
PLUGIN_OPTIONS = frozenset({"num_workers", "num_bins", "memory_budget_bytes", "slab_bytes",
                            "pin_memory", "direct_io", "checksum", "worker_nice_increment"})


def plugin_config(owner: str, options: Mapping[str, Any]) -> EngineConfig:
    """The `EngineConfig` of a plugin's keyword options, validated.

    Raises:
        ValueError: an option the plugins do not take (naming it), or a bad value.
    """
    unknown = sorted(set(options) - PLUGIN_OPTIONS)
    if unknown:
        raise ValueError(f"{owner}: unknown option {unknown[0]!r}; expected some of "
                         f"{sorted(PLUGIN_OPTIONS)} (DCP coordinates the ranks, so "
                         "asynctron's keep_last, job and coordination_timeout_s do not apply)")
    return EngineConfig(**options)


class _LocalEngine(Engine):
    """An `Engine` whose own save protocol never leaves the process: under DCP, DCP's
    collectives coordinate the ranks, so starting it joins no process group."""

    async def _collectives(self) -> tuple[SoloCollectives, SoloCollectives]:
        return SoloCollectives(), SoloCollectives()


class Runtime:
    """An engine on a loop thread of its own, with the pools the plugins use.

    Not constructed directly; `runtime_for` returns the process's runtime for an option set.

    Memory: `pool`'s budget, `memory_budget_bytes`, bounds the writers' slabs and the reader's
    buffers (read in waves, each borrowing from it); `staging_budget` bounds, separately, what
    `AsyncStager` lends the staged copies it hands to DCP (they are held until their save
    ends, so they cannot share the writers' budget without starving them; what it cannot lend
    at once is staged outside it, with a warning).
    """

    def __init__(self, config: EngineConfig, file_io: FileIO | None) -> None:
        self.config = config
        self.file_io = file_io or LocalFileIO()
        self.pinned = torch.cuda.is_available() if config.pin_memory is None else (
            config.pin_memory)
        self._loop_thread = LoopThread("asynctron-dcp")
        self._in_flight: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.engine = _LocalEngine(config, file_io=self.file_io)
        try:
            self.call(self.engine.start())
        except BaseException:
            self._stop_loop()
            raise
        self.run_blocking = self.engine.run_blocking
        self.pool = SlabPool(self.engine.budget, config.slab_bytes, self.pinned,
                             self.run_blocking)
        self.staging_budget = ByteBudget(config.memory_budget_bytes)
        SLAB_CACHE.admit(config.memory_budget_bytes)
        self.copy_streams = CopyStreams()

    @property
    def closed(self) -> bool:
        """Whether `close` was called (at interpreter exit): nothing more can start."""
        return self._closed

    def start(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` on the runtime's loop; returns at once with its future. The runtime
        owns it: `close` waits for it."""
        with self._lock:
            if self._closed:
                coroutine.close()
                raise RuntimeError("asynctron.dcp runtime: closed (the interpreter is exiting)")
            future = self._loop_thread.submit(coroutine)
            self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        return future

    def run_soon(self, fn: Callable[..., object], /, *args: Any) -> bool:
        """Run blocking `fn(*args)` on the engine's executor, later; returns at once, whether
        it was scheduled (False once the loop is gone: the caller runs it itself). Takes no
        lock, so a finalizer may call it from a garbage collection on any thread, even one in
        `start`. The runtime owns the call, as `start`'s; once closing, the loop's thread
        runs it."""
        if self._closed:
            return False
        try:
            self._loop_thread.loop.call_soon_threadsafe(self._spawn, fn, args)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _spawn(self, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        """On the loop: `run_soon`'s call, on the executor (or here, once closing)."""
        try:
            self.start(self.run_blocking(fn, *args))
        except RuntimeError:  # closed: no more work is waited for; do it now
            fn(*args)

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the runtime's loop and block the calling thread for its result.

        Raises:
            RuntimeError: called on the runtime's own loop thread (it would deadlock).
        """
        self._loop_thread.refuse_own_thread(coroutine, "asynctron.dcp plugin")
        return self.start(coroutine).result()

    def close(self) -> None:
        """Wait for the work in flight, close the engine and stop the loop thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = list(self._in_flight)
        concurrent.futures.wait(in_flight)
        try:
            self._loop_thread.submit(self.engine.aclose(raise_unobserved=False)).result()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop_thread.stop()


_RUNTIMES: dict[tuple[EngineConfig, FileIO | None], Runtime] = {}
_RUNTIMES_LOCK = threading.Lock()


def runtime_for(config: EngineConfig, file_io: FileIO | None = None) -> Runtime:
    """The process's runtime for `config` (and `file_io`, a fault-injecting fake in tests),
    started on first use."""
    key = (config, file_io)
    with _RUNTIMES_LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            runtime = _RUNTIMES[key] = Runtime(config, file_io)
        return runtime


@atexit.register
def _close_runtimes() -> None:
    with _RUNTIMES_LOCK:
        runtimes = list(_RUNTIMES.values())
        _RUNTIMES.clear()
    for runtime in runtimes:
        runtime.close()
