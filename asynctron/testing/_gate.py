"""`Gate`: one operation held at a point until the test releases it (from any loop or
thread)."""

from __future__ import annotations

import asyncio
import threading


class Gate:
    """The next operation at one point (of a `FaultyBackend`, a `GatedObjectClient`), held at
    its start until `release()`. Not constructed directly; returned by their `hold`. Thread-safe: a
    test on any loop, or on a plain thread, may wait for it and release it."""

    def __init__(self, point: str) -> None:
        self.point = point
        self._lock = threading.Lock()
        self._reached = _Signal(self._lock)
        self._released = _Signal(self._lock)

    async def reached(self) -> None:
        """Wait until an operation is held here."""
        await self._reached.wait()

    def wait_reached(self, timeout_s: float) -> bool:
        """Block until an operation is held here (or `timeout_s` passes: returns False)."""
        return self._reached.wait_blocking(timeout_s)

    def release(self) -> None:
        """Let the held operation (or the next one to arrive) go on."""
        self._released.set()

    def _pass_blocking(self) -> None:
        """On an executor thread: say so, then wait for `release`."""
        self._reached.set()
        self._released.wait_blocking(None)

    async def _pass(self) -> None:
        """On a loop: say so, then wait for `release`."""
        self._reached.set()
        await self._released.wait()


class _Signal:
    """A flag set once, awaited from any loop or waited for on any thread."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._event = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def set(self) -> None:
        with self._lock:
            self._event.set()
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def wait(self) -> None:
        event = asyncio.Event()
        with self._lock:
            if self._event.is_set():
                return
            self._waiters.append((asyncio.get_running_loop(), event))
        await event.wait()

    def wait_blocking(self, timeout_s: float | None) -> bool:
        return self._event.wait(timeout_s)
