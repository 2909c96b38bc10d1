"""`SaveResources`: what an engine's saves and loads share, and what the DCP plugins build on.

One object holds them: the executor behind the blocking door (`run_blocking`: file I/O, CUDA
waits and copies never run on the loop), the byte budget and the staging pool over the
process-wide slab cache, the CUDA copy streams, and the storage backend (given, or the one
each path's URL names). `Engine` makes one and adds the save protocol (coordination, plan
cache, tasks); the DCP plugins' runtime makes one and lets DCP coordinate.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from asynctron._budget import ByteBudget
from asynctron._concurrency import uncancellable
from asynctron.engine._slabs import SlabPool
from asynctron.engine._staging import CopyStreams
from asynctron.errors import ClosedError
from asynctron.storage.backends import Backend, CheckpointStorage, backend_for

if TYPE_CHECKING:
    from asynctron.engine._config import EngineConfig

T = TypeVar("T")


class SaveResources:
    """The executor, budget, staging pool, copy streams and backend of one engine.

    Not constructed directly by users; `Engine` and the DCP plugins' runtime make one each.

    Memory: the staging pool borrows at most `config.memory_budget_bytes` from `budget`.
    """

    def __init__(self, config: EngineConfig, backend: Backend | None) -> None:
        self.config = config
        self._backend = backend
        self.budget = ByteBudget(config.memory_budget_bytes)
        self.pool = SlabPool(self.budget, config.slab_bytes, config.pin_memory,
                             self.run_blocking)
        self.copy_streams = CopyStreams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Bind to the running loop and start the executor's threads (`num_workers`, each
        `worker_nice_increment` below the calling thread)."""
        self._loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(
            self.config.num_workers, thread_name_prefix="asynctron-io",
            initializer=_lower_thread_priority, initargs=(self.config.worker_nice_increment,))

    def shutdown(self, *, unbind: bool = False) -> None:
        """Stop the executor, not waiting for it: every `run_blocking` caller waits for its
        own thread, so none is busy for long, and waiting here would block the loop. Later
        calls raise `ClosedError`; with `unbind`, the resources are as if never started."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        if unbind:
            self._loop = None

    def backend_of(self, path: str | os.PathLike[str]) -> Backend:
        """The backend of `path`: the one given, else the one its URL names.

        Raises:
            ValueError: a URL whose scheme no backend serves.
        """
        return self._backend or backend_for(path)

    def locate(self, path: str | os.PathLike[str]) -> tuple[CheckpointStorage, str]:
        """The checkpoints of `path`'s backend (`backend_of`), bound to this executor, and
        `path`'s canonical name there."""
        backend = self.backend_of(path)
        return backend.checkpoints(self.run_blocking), backend.locate(path)

    async def run_blocking(self, fn: Callable[..., T], /, *args: Any) -> T:
        """Run blocking `fn(*args)` on the executor; the loop stays free.

        The result reaches the awaiting task in two loop iterations (the thread's callback,
        then the task): an async trainer whose steps hold the loop gives one per step.

        Cancellation: the thread cannot be interrupted; the call finishes, then the
        cancellation is raised (so no buffer is reused while a thread still touches it).
        """
        loop = self._loop
        if loop is None:
            raise RuntimeError("engine: not started; use `async with Engine() as engine`")
        if self._executor is None:
            raise ClosedError("engine: closed; create a new Engine")
        done: asyncio.Future[T] = loop.create_future()
        call = self._executor.submit(fn, *args)
        call.add_done_callback(lambda _: loop.call_soon_threadsafe(_settle, done, call))
        try:
            return await done
        except asyncio.CancelledError:
            finished = asyncio.wrap_future(call, loop=loop)
            await uncancellable(finished)
            if not finished.cancelled():
                finished.exception()  # the cancellation wins; mark the thread's error as seen
            raise


def _settle(future: asyncio.Future[T], call: concurrent.futures.Future[T]) -> None:
    """On the loop: pass the executor call's outcome to `future` (unless its awaiter left)."""
    if future.cancelled():
        return
    error = call.exception()
    if isinstance(error, StopIteration):  # a future refuses it: its awaiter would never wake
        wrapped = RuntimeError("a blocking call raised StopIteration, which cannot cross into "
                               "asyncio; it is this error's __cause__")
        wrapped.__cause__ = error
        error = wrapped
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(call.result())


def _lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value by `increment` (Linux, where it is per thread;
    elsewhere it would be the whole process's, so nothing is done)."""
    if increment and sys.platform == "linux":
        thread = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, nice + increment))
