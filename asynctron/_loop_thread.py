"""`LoopThread`: a uvloop loop on a daemon thread of its own, for code on other threads.

What a synchronous caller of asynctron stands on: `BackgroundEngine` (a synchronous trainer)
and the DCP plugins' runtime (DCP calls its plugins synchronously) each run their engine on
one, and hand it coroutines from the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


class LoopThread:
    """A uvloop loop running on a daemon thread called `name`, from construction to `stop`.

    Concurrency: `submit` and `call` from any thread; `call` refuses the loop's own thread,
    where it would wait for itself.
    """

    def __init__(self, name: str) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._thread.name

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` on the loop; returns at once with its future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, T], owner: str,
             timeout: float | None = None) -> T:
        """Run `coroutine` on the loop and block the calling thread for its result.

        Raises:
            RuntimeError: called on the loop's own thread (naming `owner`; the coroutine is
                closed, never run).
            TimeoutError: not done within `timeout` seconds (the coroutine is then
                cancelled).
        """
        self.refuse_own_thread(coroutine, owner)
        future = self.submit(coroutine)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{owner}: coroutine not done within {timeout} s; it was "
                               "cancelled") from None

    def refuse_own_thread(self, coroutine: Coroutine[Any, Any, Any], owner: str) -> None:
        """Raise RuntimeError (closing `coroutine`) when called on the loop's own thread."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError(f"{owner}: called on its own loop thread ({self.name}), where "
                               "it would wait for itself; await the coroutine there instead")

    def stop(self) -> None:
        """Stop the loop, wait for its thread to end and close it."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
