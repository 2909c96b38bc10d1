"""`Turns`: a phase of a protocol that saves pass one at a time, in request order, so every
rank issues that phase's collectives in the same order however many saves are in flight."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Turns:
    """Lets saves through one phase of the protocol one at a time, in request order (seq 1, 2,
    ...), so every rank issues that phase's collectives in the same order, however many saves
    are in flight. Every save passes each phase exactly once: `take` it or `skip` it."""

    def __init__(self) -> None:
        self._passed = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def take(self, seq: int) -> AsyncIterator[None]:
        """Wait for the saves before `seq` to pass, run the body, pass."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._passed == seq - 1)
        try:
            yield
        finally:
            await self.skip(seq)

    async def skip(self, seq: int) -> None:
        """Pass without running anything (every rank skips the same phase of the same save)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._passed >= seq - 1)
            self._passed = max(self._passed, seq)
            self._changed.notify_all()
