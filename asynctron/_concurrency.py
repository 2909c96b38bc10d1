"""Shared asyncio building blocks for every part: the blocking-call door type, cleanup and
work that cannot be cut short, and one error out of a failed task group.

Lives outside `engine` so that `storage`, `comm` and `datasets` use the same pieces without
importing the engine (arrows run one way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from asynctron.errors import AsynctronError

T = TypeVar("T")


class RunBlocking(Protocol):
    """Runs a blocking callable off the loop thread and awaits it: the engine's executor door
    (`Engine.run_blocking`), passed to the parts that must never block the loop."""

    def __call__(self, fn: Callable[..., T], /, *args: object) -> Awaitable[T]: ...


async def uncancellable(awaitable: asyncio.Future[Any]) -> None:
    """Wait for `awaitable` to finish even if we are cancelled meanwhile; re-raise the
    cancellation afterwards. For cleanup that must not be cut short."""
    cancelled = False
    while not awaitable.done():
        try:
            await asyncio.wait([awaitable])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def to_its_end(awaitable: Awaitable[T], *,
                     on_cancel: Callable[[], object] = lambda: None) -> T:
    """`awaitable`'s result. Cancelled meanwhile: `on_cancel()` (to hasten it), then wait for
    it to end and re-raise the cancellation (which wins over its own error, marked seen). For
    work that must not be cut off half-way (a commit, a transfer, a request that makes an
    object)."""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        on_cancel()
        await uncancellable(task)
        if not task.cancelled():
            task.exception()
        raise


def first_error(error: BaseException) -> BaseException:
    """The one error to raise for a failed task group: the first asynctron error, else the
    first error; bare cancellation only if nothing else failed."""
    if not isinstance(error, BaseExceptionGroup):
        return error
    leaves: list[BaseException] = []
    stack = [error]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    for kind in (AsynctronError, Exception, BaseException):
        for leaf in leaves:
            if isinstance(leaf, kind) and not isinstance(leaf, asyncio.CancelledError):
                return leaf
    return leaves[0]
