"""`Runtime`: the save resources the DCP plugins run on, one per option set in the process.

DCP calls its storage plugins synchronously, from the trainer's thread (`dcp.save`,
`dcp.load`) or from DCP's own save thread (`dcp.async_save`). A runtime is the engine's
`SaveResources` (executor, budget, staging pool, copy streams, backend) bound to a uvloop loop
on a daemon thread of its own (`LoopThread`, as `BackgroundEngine`'s): plugin calls hand it
coroutines and wait on (or return) their futures; the loop never blocks, and every file
syscall, copy and CUDA wait runs on the bounded executor.

Runtimes are process-wide and shared: every `StorageWriter`, `StorageReader` and `AsyncStager`
built with the same options uses the same one (so the same budgets), made on first use and
closed when the interpreter exits. Across ranks, DCP does the coordination (its own collectives
on the default or given process group): a runtime has no save protocol of its own, and joins
no process group.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from asynctron._budget import ByteBudget
from asynctron._loop_thread import LoopThread
from asynctron.engine import EngineConfig
from asynctron.engine.lowlevel import SLAB_CACHE, SaveResources
from asynctron.storage import Backend, store_operation

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


class Runtime:
    """Save resources on a loop thread of its own, with the pools the plugins use.

    Not constructed directly; `runtime_for` returns the process's runtime for an option set.

    Memory: `pool`'s budget, `memory_budget_bytes`, bounds the writers' slabs and the reader's
    buffers (read in waves, each borrowing from it); `staging_budget` bounds, separately, what
    `AsyncStager` lends the staged copies it hands to DCP (they are held until their save
    ends, so they cannot share the writers' budget without starving them; what it cannot lend
    at once is staged outside it, with a warning).
    """

    def __init__(self, config: EngineConfig, backend: Backend | None) -> None:
        self.config = config
        self._loop_thread = LoopThread("asynctron-dcp")
        self._in_flight: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.resources = SaveResources(config, backend)
        try:
            self.call(_start(self.resources))
        except BaseException:
            self._stop_loop()
            raise
        self.run_blocking = self.resources.run_blocking
        self.pool = self.resources.pool
        self.copy_streams = self.resources.copy_streams
        self.staging_budget = ByteBudget(config.memory_budget_bytes)
        SLAB_CACHE.admit(config.memory_budget_bytes)

    @property
    def closed(self) -> bool:
        """Whether `close` was called (at interpreter exit): nothing more can start."""
        return self._closed

    def start(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` on the runtime's loop, as one store operation (on an object store,
        one clock for all its requests); returns at once with its future. The runtime owns
        it: `close` waits for it."""
        with self._lock:
            if self._closed:
                coroutine.close()
                raise RuntimeError("asynctron.dcp runtime: closed (the interpreter is exiting)")
            future = self._loop_thread.submit(_one_operation(coroutine))
            self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        return future

    def start_soon(self, coroutine_fn: Callable[..., Coroutine[Any, Any, object]], /,
                   *args: Any) -> bool:
        """Run `coroutine_fn(*args)` on the runtime's loop, later; returns at once, whether it
        was scheduled (False once the runtime is closing). Takes no lock, so a finalizer may
        call it from a garbage collection on any thread, even one in `start`. The runtime owns
        the coroutine, as `start`'s."""
        if self._closed:
            return False
        try:
            self._loop_thread.loop.call_soon_threadsafe(self._spawn, coroutine_fn, args)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _spawn(self, coroutine_fn: Callable[..., Coroutine[Any, Any, object]],
               args: tuple[Any, ...]) -> None:
        """On the loop: `start_soon`'s coroutine (dropped if the runtime closed meanwhile)."""
        with contextlib.suppress(RuntimeError):  # closed: no more work is waited for
            self.start(coroutine_fn(*args))

    def call(self, coroutine: Coroutine[Any, Any, T], *,
             interrupted: Callable[[concurrent.futures.Future[T]], object] | None = None) -> T:
        """Run `coroutine` on the runtime's loop and block the calling thread for its result.

        An interrupt of the wait (KeyboardInterrupt, SystemExit) is raised at once; the
        coroutine goes on, and `interrupted` (if given) is called with its future first, to
        settle what it makes (an area, a lease) once it ends.

        Raises:
            RuntimeError: called on the runtime's own loop thread (it would deadlock).
        """
        self._loop_thread.refuse_own_thread(coroutine, "asynctron.dcp plugin")
        future = self.start(coroutine)
        try:
            return future.result()
        except BaseException as error:
            if interrupted is not None and not isinstance(error, Exception):
                interrupted(future)
            raise

    def close(self) -> None:
        """Wait for the work in flight, stop the executor and the loop thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = list(self._in_flight)
        concurrent.futures.wait(in_flight)
        try:
            self.resources.shutdown()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop_thread.stop()


_RUNTIMES: dict[tuple[EngineConfig, Backend | None], Runtime] = {}
_RUNTIMES_LOCK = threading.Lock()


def runtime_for(config: EngineConfig, backend: Backend | None = None) -> Runtime:
    """The process's runtime for `config` (and `backend`, a fault-injecting fake in tests;
    None: each path's own), started on first use."""
    key = (config, backend)
    with _RUNTIMES_LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            runtime = _RUNTIMES[key] = Runtime(config, backend)
        return runtime


async def _start(resources: SaveResources) -> None:
    resources.start()


async def _one_operation(coroutine: Coroutine[Any, Any, T]) -> T:
    with store_operation("DCP plugin step"):
        return await coroutine


@atexit.register
def _close_runtimes() -> None:
    with _RUNTIMES_LOCK:
        runtimes = list(_RUNTIMES.values())
        _RUNTIMES.clear()
    for runtime in runtimes:
        runtime.close()
