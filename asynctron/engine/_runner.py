"""`BackgroundEngine`: the same engine for synchronous trainers, on a loop in its own thread.

One uvloop loop runs on a daemon thread; calls from the trainer's thread reach it through
`asyncio.run_coroutine_threadsafe`. The returned `SaveTask` offers `staged.result()` and
`result()` to the trainer's thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, Literal, TypeVar

import uvloop

from asynctron.engine._engine import Engine
from asynctron.engine._task import SaveTask
from asynctron.errors import ClosedError

T = TypeVar("T")


class BackgroundEngine:
    """An `Engine` on a background thread; use as `with BackgroundEngine(...) as engine:`.

    Keyword arguments are those of `Engine`. Methods are called from any thread except the
    background loop's own.
    """

    def __init__(self, **engine_kwargs: Any) -> None:
        self._engine = Engine(**engine_kwargs)  # validates the config here, on the caller
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="asynctron-loop", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._call(self._engine.start())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def engine(self) -> Engine:
        return self._engine

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self._closed:
            coroutine.close()
            raise ClosedError("background engine: closed; create a new one")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def save(self, state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
             snapshot: bool = True, format: Literal["asynctron", "dcp"] = "asynctron"
             ) -> SaveTask:
        """Start a save; returns once it is validated (planning and writing go on in the
        background). See `Engine.save`.

        `task.staged.result()` blocks until the tensors may be mutated; `task.result()` until
        the checkpoint is committed. A one-shot save that waits for the commit anyway is
        fastest with `snapshot=False`: `engine.save(state, path, snapshot=False).result()`
        writes CPU tensors from their own memory, with no copy.
        """

        async def start() -> SaveTask:
            return self._engine.save(state_dict, path, snapshot=snapshot, format=format)

        return self._call(start())

    def prefault_staging(self, nbytes: int | None = None) -> int:
        """Make staging memory ready now, blocking the calling thread. See
        `Engine.prefault_staging`."""
        return self._call(self._engine.prefault_staging(nbytes))

    def load(self, path: str | os.PathLike[str], **kwargs: Any) -> Any:
        """Load a checkpoint, blocking the calling thread. See `Engine.load`."""
        return self._call(self._engine.load(path, **kwargs))

    def close(self) -> None:
        """Wait for saves in flight, close the engine and stop the loop thread."""
        if self._closed:
            return
        try:
            self._call(self._engine.aclose())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> BackgroundEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
