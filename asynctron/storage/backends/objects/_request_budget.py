"""`RequestBudget`: how many requests a process keeps in flight at one store, adapted to what
the store allows.

Stores throttle by answering 503 SlowDown (or 429) to requests beyond the rate or
concurrency they serve. Retrying such a request at once only hammers the store again; the
budget instead slows the client down, as TCP's congestion window does, and remembers where
the store refused, as CUBIC remembers the window of its last loss:

- The window starts at the configured most; a store that never throttles keeps it there.
- A throttled request teaches the limit: the fewest requests in flight (counted when each
  was sent, itself included) that the store refused. The window drops below it at once, and
  the throttle of a request sent since the last cut also shrinks it to 0.7 of the requests
  in flight when it was sent (multiplicative decrease). Requests sent before the last cut
  do not cut it again (they were sent at the old size), so a burst of throttles shrinks the
  window once, not once per request; they still teach the limit.
- While a limit is known, the window grows back by one per answer to the limit's plateau,
  one below the limit (the most the store is known to serve), stays there for
  `PROBE_ANSWERS` answers, then reaches the limit: requests sent at the limit probe it.
  Throttled, the probe cuts again (one refusal in `PROBE_ANSWERS` and more, against a store
  that serves a fixed number); answered for another `PROBE_ANSWERS`, the store serves more
  now, and the limit is forgotten. (Answers, not the count in flight, are the proof: a
  refused request holds its place in the window until its 503 comes back, so the count in
  flight when a request was sent overstates what the store was serving.)
- With no limit known, the window grows by one per window's worth of answers, up to the
  most (additive increase).
- Only an answer to a request sent while the window was full grows it: a client that keeps
  fewer requests in flight has not shown the store serves more.
- At one request in flight, a throttle cannot shrink the window: the caller backs off.

    budget = RequestBudget(64)
    async with budget.slot() as slot:       # waits while the window is full
        try:
            await send()
        except Throttled:
            budget.throttled(slot)
            raise
        budget.answered(slot)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

_DECREASE = 0.7
"""A throttle shrinks the window to this share of the requests in flight when the throttled
one was sent (CUBIC's beta, as the AWS SDKs' adaptive retry mode uses)."""
PROBE_ANSWERS = 16
"""Answers the window spends on the limit's plateau before it probes the limit: against a
store that serves a fixed number in flight, at most one request in `PROBE_ANSWERS + 1` is
refused once the window has settled."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One request's place in the budget, as it was sent."""

    generation: int
    """The window's generation it was sent in (each cut starts one)."""
    in_flight: int
    """The requests in flight when it was sent, itself included."""
    filled_window: bool
    """Whether it filled the window."""


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
        self._limit: int | None = None
        self._generation = 0
        self._in_flight = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.most_in_flight = 0
        """The most requests in flight at once so far."""
        self.num_cuts = 0
        """Times a throttled request shrank the window multiplicatively."""
        self.least_window = most
        """The smallest the window has been."""

    @property
    def window(self) -> int:
        """The requests that may be in flight now."""
        return int(self._window)

    @property
    def limit(self) -> int | None:
        """The fewest requests in flight the store refused since it last showed it serves
        more (the window stays below it but to probe it); None: none known."""
        return self._limit

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
            yield Slot(self._generation, self._in_flight, self._in_flight >= self.window)
        finally:
            self._in_flight -= 1
            self._wake()

    def answered(self, slot: Slot) -> None:
        """The store answered the request in `slot`. If it was sent while the window was
        full, the window grows: by one per answer up to the limit's plateau, by
        1/`PROBE_ANSWERS` from there (forgetting the limit once it is one past it), by
        1/window with no limit known (up to `most`)."""
        if not slot.filled_window:
            return
        limit = self._limit
        if limit is None:
            window = min(float(self.most), self._window + 1.0 / self._window)
        elif self._window < limit - 1:
            window = min(float(limit - 1), self._window + 1.0)
        else:
            window = min(float(self.most), self._window + 1.0 / PROBE_ANSWERS)
            if window >= limit + 1 or window >= self.most:
                self._limit = None  # the store served the limit for `PROBE_ANSWERS` answers
        if window > self._window:
            self._window = window
            self._wake()

    def throttled(self, slot: Slot) -> bool:
        """The store throttled the request in `slot`: learn the limit, keep the window below
        it, and, unless the request was sent before the last cut, shrink the window to
        `_DECREASE` of the requests in flight when it was sent (a 503 that comes back after
        the others' answers would otherwise cut to what is left in flight). True if the
        window shrank (False at one request: the caller backs off instead)."""
        if self._limit is None or slot.in_flight < self._limit:
            self._limit = slot.in_flight
        cut = slot.generation == self._generation
        window = self._window
        if cut:
            window = min(window, float(slot.in_flight)) * _DECREASE
        window = max(1.0, min(window, float(self._limit - 1)))
        if window >= self._window:
            return False
        if cut:
            self._generation += 1
            self.num_cuts += 1
        self._window = window
        self.least_window = min(self.least_window, self.window)
        return True

    def _wake(self) -> None:
        """Hand free places to the oldest waiters."""
        while self._waiters and self._in_flight < self.window:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._in_flight += 1
                waiter.set_result(None)

    def __repr__(self) -> str:
        limit = "" if self._limit is None else f", limit {self._limit}"
        return (f"<RequestBudget {self._in_flight} in flight of {self.window} (most "
                f"{self.most}{limit}), {len(self._waiters)} waiting, {self.num_cuts} cuts>")


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
