"""`BackgroundEngine`: the same engine for synchronous trainers, on a loop in its own thread.

One uvloop loop runs on a daemon thread (`LoopThread`); calls from the trainer's thread hand
it coroutines and block that thread until they are done. `Engine`'s methods
are here with the same arguments, synchronous; `run`, `enter` and `iterate` drive the rest of
asynctron (an `AsyncLoader`, a `BucketManager`) on the same loop.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, TypeVar, Unpack

import torch.distributed as dist

from asynctron._loop_thread import LoopThread
from asynctron.engine._config import EngineConfig, EngineOptions
from asynctron.engine._engine import Engine
from asynctron.engine._task import SaveTask
from asynctron.engine.tiers import RestoreResult
from asynctron.errors import ClosedError
from asynctron.storage import Backend

T = TypeVar("T")


class BackgroundEngine:
    """An `Engine` on a background thread; use as `with BackgroundEngine(...) as engine:`.

    Takes `Engine`'s arguments (`config` or its fields as keywords, `backend`,
    `process_group`) and starts the engine before returning. Methods are called from any
    thread except the background loop's own (they raise RuntimeError there).

    A synchronous trainer drives the rest of asynctron on the same loop, passing the
    engine's async door (`bg.engine.run_blocking`) where a `run_blocking` door is asked for:

        with BackgroundEngine(num_workers=4) as bg:
            model = AsyncDataParallel(net, run_blocking=bg.engine.run_blocking)
            loader = AsyncLoader(dataset, micro_batch_size=8, num_ready_batches=2,
                                 prefetch_budget=64 << 20, run_blocking=bg.engine.run_blocking)
            with bg.enter(loader):
                for batch in bg.iterate(loader):
                    loss_fn(model(batch)).backward()
                    bg.run(model.step(optimizer))
    """

    def __init__(self, config: EngineConfig | None = None, *, backend: Backend | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 store_backend: Backend | None = None,
                 **options: Unpack[EngineOptions]) -> None:
        # built (and its config validated) here, on the caller
        self._engine = Engine(config, backend=backend, process_group=process_group,
                              store_backend=store_backend, **options)
        self._loop_thread = LoopThread("asynctron-loop")
        self._closed = False
        try:
            self._call(self._engine.start())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def engine(self) -> Engine:
        """The `Engine` itself, bound to the background loop (its coroutines run there only)."""
        return self._engine

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def rank(self) -> int:
        """See `Engine.rank`."""
        return self._engine.rank

    @property
    def num_coordination_calls(self) -> int:
        """See `Engine.num_coordination_calls`."""
        return self._engine.num_coordination_calls

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self._closed:
            coroutine.close()
            raise ClosedError("background engine: closed; create a new one")
        return self._loop_thread.call(coroutine, "background engine", timeout)

    def run(self, coroutine: Coroutine[Any, Any, T], *, timeout: float | None = None) -> T:
        """Run `coroutine` on the engine's loop and return its result, blocking the calling
        thread: `engine.run(manager.synchronize())`, `engine.run(model.step(optimizer))`.

        Raises:
            what the coroutine raised; ClosedError: the engine is closed; TimeoutError: not
            done within `timeout` seconds (the coroutine is then cancelled).

        Cancellation: none from this side but `timeout`; the coroutine's own docstring says
        what a cancellation leaves behind.
        """
        return self._call(coroutine, timeout)

    @contextlib.contextmanager
    def enter(self, resource: AbstractAsyncContextManager[T]) -> Iterator[T]:
        """`async with resource` on the engine's loop, as a plain `with`:
        `with engine.enter(loader): ...` starts an `AsyncLoader`'s workers and closes them."""

        async def aenter() -> T:
            return await resource.__aenter__()

        async def aexit(error: BaseException | None) -> bool | None:
            return await resource.__aexit__(
                None if error is None else type(error), error,
                None if error is None else error.__traceback__)

        value = self._call(aenter())
        try:
            yield value
        except BaseException as error:
            if not self._call(aexit(error)):
                raise
        else:
            self._call(aexit(None))

    def iterate(self, iterable: AsyncIterable[T]) -> Iterator[T]:
        """`async for item in iterable` on the engine's loop, as a plain `for`:
        `for batch in engine.iterate(loader)`. Each `next()` blocks until the item is ready."""

        async def start() -> AsyncIterator[T]:
            return aiter(iterable)

        async def step(iterator: AsyncIterator[T]) -> tuple[bool, T | None]:
            try:
                return True, await anext(iterator)
            except StopAsyncIteration:
                return False, None

        iterator = self._call(start())
        while True:
            more, item = self._call(step(iterator))
            if not more:
                return
            yield item  # type: ignore[misc]

    def run_blocking(self, fn: Callable[..., T], /, *args: Any) -> T:
        """Run blocking `fn(*args)` on the engine's executor and return its result, blocking the
        calling thread. See `Engine.run_blocking`."""
        return self._call(self._engine.run_blocking(fn, *args))

    def save(self, state_dict: Mapping[str, Any], path: str | os.PathLike[str] | None = None,
             *, step: int | None = None, snapshot: bool = True,
             format: Literal["asynctron", "dcp"] = "asynctron") -> SaveTask:
        """Start a save (to `path`, or with `step` to the engine's tiers); returns once it is
        validated (planning and writing go on in the background). See `Engine.save`.

        `task.staged.result()` blocks until the tensors may be mutated; `task.result()` until
        the checkpoint is committed. A one-shot save that waits for the commit anyway is
        fastest with `snapshot=False`: `engine.save(state, path, snapshot=False).result()`
        writes CPU tensors from their own memory, with no copy.
        """

        async def start() -> SaveTask:
            return self._engine.save(state_dict, path, step=step, snapshot=snapshot,
                                     format=format)

        return self._call(start())

    def restore(self, state_dict: Mapping[str, Any], *, step: int | None = None
                ) -> RestoreResult:
        """Restore `state_dict` in place from the tiers, blocking the calling thread. See
        `Engine.restore`."""
        return self._call(self._engine.restore(state_dict, step=step))

    def load(self, path: str | os.PathLike[str], *, mmap: bool = False,
             verify: bool | None = None, collective: bool = False) -> dict[str, Any]:
        """Load a checkpoint into new objects, blocking the calling thread. See `Engine.load`."""
        return self._call(self._engine.load(path, mmap=mmap, verify=verify,
                                            collective=collective))

    def load_into(self, state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
                  verify: bool = True, collective: bool = False) -> dict[str, Any]:
        """Load a checkpoint into `state_dict`'s tensors and arrays in place, blocking the
        calling thread. See `Engine.load_into`."""
        return self._call(self._engine.load_into(state_dict, path, verify=verify,
                                                 collective=collective))

    def prefault_staging(self, nbytes: int | None = None) -> int:
        """Make staging memory ready now, blocking the calling thread. See
        `Engine.prefault_staging`."""
        return self._call(self._engine.prefault_staging(nbytes))

    def close(self) -> None:
        """Wait for saves in flight, close the engine and stop the loop thread (`Engine.aclose`,
        synchronous)."""
        if self._closed:
            return
        try:
            self._call(self._engine.aclose())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop_thread.stop()

    def __enter__(self) -> BackgroundEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<BackgroundEngine on thread {self._loop_thread.name}: {self._engine!r}>"
