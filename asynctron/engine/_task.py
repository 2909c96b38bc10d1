"""Handles for work the engine started: `SaveTask` and its `staged` `Milestone`.

Both are awaitable on the engine's loop and offer `done()` and `result(timeout)` to code on
other threads (a synchronous trainer driving the `BackgroundEngine`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from asynctron.storage import StoreStatistics

T = TypeVar("T")


def _check_not_loop_thread(loop: asyncio.AbstractEventLoop, what: str) -> None:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError(f"{what}.result() called on the event loop thread, where it would "
                           f"deadlock; use `await {what}` instead")


async def _wait(future: asyncio.Future[T]) -> T:
    return await asyncio.shield(future)


class Milestone(Generic[T]):
    """A point a task reaches (e.g. `SaveTask.staged`): await it, or block on `result()`.

    Not constructed directly; returned by `SaveTask.staged`.
    """

    def __init__(self, future: asyncio.Future[T], loop: asyncio.AbstractEventLoop, name: str):
        self._future = future
        self._loop = loop
        self._name = name

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.shield(self._future).__await__()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        """Block the calling thread until reached; raise what the task raised.

        Raises:
            RuntimeError: called on the engine's loop thread.
            TimeoutError: not reached within `timeout` seconds.
        """
        _check_not_loop_thread(self._loop, self._name)
        future = asyncio.run_coroutine_threadsafe(_wait(self._future), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self._name} not reached within {timeout} s") from None


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What a committed save wrote, and where the time went."""

    path: str
    """The committed checkpoint directory."""
    nbytes: int
    """Item bytes written (padding excluded)."""
    files: tuple[str, ...]
    """Data file names inside `path` (one per non-empty bin)."""
    num_items: int
    """Tensors, arrays and bytes values written."""
    plan_s: float
    """From the request until this rank's plan was ready: the start and plan exchange across
    ranks, DCP's planner, chunking, split and layout (or a cached plan)."""
    stage_s: float
    """From the request until every item was copied out (the caller's tensors were free)."""
    write_s: float
    """From the request until every data file was written and fsynced."""
    commit_s: float
    """Manifest, directory fsyncs, rename and `latest` update."""
    total_s: float
    """From the request until committed."""
    pruned: tuple[str, ...] = ()
    """Checkpoints deleted after the commit: this job's beyond `keep_last` (also logged)."""
    warnings: tuple[str, ...] = ()
    """Problems after the commit that did not undo it: `latest` not moved, older checkpoints
    not pruned (also logged)."""
    step: int | None = None
    """The step of a save to the tiers (`Engine(tiers=...)`, `save(state, step=N)`); its
    `path` is then this rank's shard in its node's local tier."""
    store: StoreStatistics = field(default_factory=StoreStatistics)
    """What this rank asked of an object store (requests, retries, throttles, bytes, time
    waiting on it), to tell a slow store from a slow client; zeros on local files."""

    @property
    def throughput_bytes_per_s(self) -> float:
        return self.nbytes / self.total_s if self.total_s > 0 else float("inf")


class SaveTask:
    """A save in flight. `await task` → `SaveResult` once committed; `await task.staged` once
    the state dict's tensors have been copied out and may be mutated.

    Not constructed directly; returned by `Engine.save`.

    Cancellation: `task.cancel()` aborts the save; running copies and writes finish, then the
    tmp dir is removed, the memory budget is returned, and `latest` is untouched. A save
    cancelled by anything else (the loop's end under `asyncio.run`, with the engine still
    open) is logged and warned about (`RuntimeWarning`): nothing was saved.
    """

    def __init__(self, task: asyncio.Task[SaveResult], staged: asyncio.Future[None],
                 loop: asyncio.AbstractEventLoop, path: str) -> None:
        self._task = task
        self._loop = loop
        self.path = path
        self.staged: Milestone[None] = Milestone(staged, loop, "SaveTask.staged")
        self.observed = False
        """Whether anyone awaited the save or asked for its result (the engine's `aclose`
        raises a failure nobody observed)."""
        self.cancel_requested = False
        """Whether `cancel()` was called."""

    def __await__(self) -> Generator[Any, None, SaveResult]:
        self.observed = True
        return asyncio.shield(self._task).__await__()

    def done(self) -> bool:
        return self._task.done()

    def failed(self) -> bool:
        """Whether the save ended with an error (not a cancellation)."""
        return self._task.done() and not self._task.cancelled() and (
            self._task.exception() is not None)

    def failure(self) -> BaseException:
        """The error the save ended with (call when `failed()`)."""
        error = self._task.exception()
        assert error is not None, "failure() of a save that did not fail"
        return error

    def cancel(self) -> bool:
        """Request cancellation (thread-safe); returns False if already done."""
        if self._task.done():
            return False
        self.cancel_requested = True
        self._loop.call_soon_threadsafe(self._task.cancel)
        return True

    def cancelled(self) -> bool:
        """Whether the save ended cancelled (by `cancel()`, the engine, or its loop's end)."""
        return self._task.cancelled()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Block the calling thread until committed; raise what the save raised.

        Raises:
            RuntimeError: called on the engine's loop thread.
            TimeoutError: not committed within `timeout` seconds (the save goes on).
        """
        self.observed = True
        return Milestone(self._task, self._loop, "SaveTask").result(timeout)

    def __repr__(self) -> str:
        state = "done" if self._task.done() else (
            "staged" if self.staged.done() else "staging")
        return f"<SaveTask {self.path!r} {state}>"
