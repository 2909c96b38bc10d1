"""`RequestBudget`: how many requests a process keeps in flight at one store, adapted to what
the store allows.

Stores throttle by answering 503 SlowDown (or 429) to requests beyond the rate or
concurrency they serve. Retrying such a request at once only hammers the store again; the
budget instead slows the client down as TCP's congestion window does (additive increase,
multiplicative decrease): a throttled request shrinks the window to 0.7 of the requests in
flight, each window's worth of requests answered grows it back by one, never above the
configured most; at one request in flight, the caller backs off instead. Requests sent
before the last cut do not cut it again (they were sent at the old size), so a burst of
throttles shrinks the window once, not once per request.

    budget = RequestBudget(64)
    async with budget.slot() as slot:       # waits while the window is full
        try:
            await send()
        except Throttled:
            budget.throttled(slot)
            raise
        budget.answered()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

_DECREASE = 0.7
"""A throttle shrinks the window to this share of the requests in flight (CUBIC's beta, as
the AWS SDKs' adaptive retry mode uses)."""


@dataclass(slots=True)
class Slot:
    """One request's place in the budget: the window's generation it was sent in."""

    generation: int


class RequestBudget:
    """At most `window` requests in flight (1 <= window <= `most`), waiters served in arrival
    order. One event loop.

    Concurrency: any number of tasks on that loop share it; a task cancelled while waiting
    gives its turn to the next.
    """

    def __init__(self, most: int) -> None:
        if most < 1:
            raise ValueError(f"most: expected a positive int, found {most!r}")
        self.most = most
        self._window = float(most)
        self._generation = 0
        self._in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.most_in_flight = 0
        """The most requests in flight at once so far."""
        self.num_cuts = 0
        """Times a throttled request shrank the window."""
        self.least_window = most
        """The smallest the window has been."""

    @property
    def window(self) -> int:
        """The requests that may be in flight now."""
        return int(self._window)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Slot]:
        """Hold one place in the window for the block (waiting for one first)."""
        if self._in_flight >= self.window or self._waiters:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._in_flight -= 1  # woken, then cancelled: pass the place on
                    self._wake()
                else:
                    with contextlib.suppress(ValueError):  # not yet passed over by `_wake`
                        self._waiters.remove(waiter)
                raise
        else:
            self._in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self._in_flight)
        try:
            yield Slot(self._generation)
        finally:
            self._in_flight -= 1
            self._wake()

    def answered(self) -> None:
        """The store answered a request: the window grows by 1/window (one per window's
        worth of answers), up to `most`."""
        if self._window < self.most:
            self._window = min(float(self.most), self._window + 1.0 / self._window)
            self._wake()

    def throttled(self, slot: Slot) -> bool:
        """The store throttled the request in `slot`: shrink the window to `_DECREASE` of
        the requests in flight, unless the request was sent before the last cut. True if the
        window shrank (False at one request: the caller backs off instead)."""
        if slot.generation != self._generation:
            return False
        window = max(1.0, min(self._window, float(self._in_flight)) * _DECREASE)
        if window >= self._window:
            return False
        self._generation += 1
        self._window = window
        self.least_window = min(self.least_window, self.window)
        self.num_cuts += 1
        return True

    def _wake(self) -> None:
        """Hand free places to the oldest waiters."""
        while self._waiters and self._in_flight < self.window:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._in_flight += 1
                waiter.set_result(None)

    def __repr__(self) -> str:
        return (f"<RequestBudget {self._in_flight} in flight of {self.window} (most "
                f"{self.most}), {len(self._waiters)} waiting, {self.num_cuts} cuts>")


def process_share(max_requests: int, job_max_requests: int | None, world_size: int) -> int:
    """The most requests one of `world_size` processes keeps in flight: its share of the job's
    `job_max_requests` (at least 1), at most `max_requests` (all of it without a job bound)."""
    if job_max_requests is None:
        return max_requests
    return max(1, min(max_requests, job_max_requests // max(1, world_size)))


def world_size() -> int:
    """How many processes the job has: torch.distributed's world, else torchrun's
    `WORLD_SIZE`, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    text = os.environ.get("WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else 1
