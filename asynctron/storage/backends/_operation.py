"""`StoreOperation`: one operation a user awaits (a save, a load, a dataset read), as an object
store sees it: one clock for all of its requests, and what they cost.

A save is hundreds of requests (a claim, listings, parts, the commit, and after a failure the
aborts and deletes); each is retried on its own, but they share one clock: the operation fails
once the store has answered none of its requests for the client's `deadline_s`, however many
requests are waiting. Any answer (a part stored, a range read, an object missing) restarts the
clock, so a slow or throttled store that keeps answering lets the operation finish at its pace;
the clock stands still while nothing is asked of the store (planning, staging). Once expired,
the operation asks nothing more of the store: clean-up after the failure (aborting uploads,
deleting objects) is left to the next commit's sweep instead of holding the caller.

    with store_operation() as operation:       # around everything one awaited call does
        await engine_work()                     # every request inside counts on it
    operation.statistics()                      # requests, retries, throttles, bytes, wait

The operation is found through a context variable, so the tasks a save spawns share it. A
client's requests all run on one event loop (the store I/O loop); the clock's timer and the
counters live there. Code outside any `store_operation` gets a fresh one per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_CURRENT: contextvars.ContextVar[StoreOperation | None] = contextvars.ContextVar(
    "asynctron_store_operation", default=None)


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreStatistics:
    """What an operation asked of object stores: for telling a slow store from a slow client.
    All zeros for an operation on local files."""

    num_requests: int = 0
    """HTTP requests sent (every try of every request)."""
    num_retries: int = 0
    """Tries that failed and were tried again (resets, timeouts, 5xx, throttling)."""
    num_throttled: int = 0
    """Answers that asked the client to slow down (503 SlowDown, 429)."""
    num_lists: int = 0
    """Listings sent (LIST requests: each page, each try): what many ranks multiply."""
    sent_bytes: int = 0
    """Request bodies stored (parts, objects), counted once each."""
    received_bytes: int = 0
    """Object bytes read (ranges, small objects), counted once each."""
    waiting_s: float = 0.0
    """Time with at least one request of the operation unanswered (sent, queued for the
    request budget, or waiting to be retried): the time spent waiting on the store."""

    def __str__(self) -> str:
        return (f"{self.num_requests} requests ({self.num_retries} retried, "
                f"{self.num_throttled} throttled, {self.num_lists} lists), "
                f"{self.sent_bytes} bytes sent, "
                f"{self.received_bytes} received, {self.waiting_s:.3f} s waiting on the store")


class StoreExpired(Exception):
    """Raised inside a request's `watch` scope when its operation's clock ran out."""


class StoreOperation:
    """One awaited operation's clock and counters. Made by `store_operation` (or per request,
    outside one); its request methods run on the client's event loop only.

    Not constructed directly by users; `SaveResult.store` reports its statistics.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        """What the operation is, for messages (`save`, `load`, `read`)."""
        self.deadline_s: float | None = None
        """The deadline of the first client that sent a request (one store per operation)."""
        self.expired = False
        self.expired_after_s = 0.0
        """How long the store had not answered when the clock ran out."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = 0
        self._quiet_since = 0.0
        self._busy_since = 0.0
        self._waiting_s = 0.0
        self._scopes: set[asyncio.Timeout] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._num_requests = 0
        self._num_retries = 0
        self._num_throttled = 0
        self._num_lists = 0
        self._sent_bytes = 0
        self._received_bytes = 0

    # -- the clock (on the client's loop) ---------------------------------------------------

    def begin(self, deadline_s: float) -> None:
        """A request starts (it and its retries are pending until `end`). The first request
        while nothing is pending starts the clock: time with nothing asked is never counted."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self.deadline_s = loop, deadline_s
        now = loop.time()
        if self._pending == 0:
            self._quiet_since = self._busy_since = now
        self._pending += 1

    def end(self) -> None:
        """The request begun by `begin` is over (answered or failed for good)."""
        self._pending -= 1
        if self._pending == 0:
            assert self._loop is not None
            self._waiting_s += self._loop.time() - self._busy_since
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def answered(self, *, sent_bytes: int = 0, received_bytes: int = 0) -> None:
        """The store answered one of the operation's requests: the clock starts again."""
        assert self._loop is not None
        self._quiet_since = self._loop.time()
        self._sent_bytes += sent_bytes
        self._received_bytes += received_bytes

    def quiet_s(self) -> float:
        """How long the store has not answered any of the operation's pending requests."""
        assert self._loop is not None
        return self._loop.time() - self._quiet_since

    def count_try(self, *, retry: bool, listing: bool = False) -> None:
        """A try of a request is sent (`retry`: a request's second or later; `listing`: a
        LIST)."""
        self._num_requests += 1
        self._num_retries += retry
        self._num_lists += listing

    def count_throttled(self) -> None:
        """The store asked the client to slow down."""
        self._num_throttled += 1

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[None]:
        """Run one try of a request; raise `StoreExpired` out of it if the operation's clock
        runs out meanwhile (whatever the request was waiting on)."""
        if self.expired:
            raise StoreExpired
        scope = asyncio.timeout(None)
        try:
            async with scope:
                self._scopes.add(scope)
                self._arm()
                try:
                    yield
                finally:
                    self._scopes.discard(scope)
        except TimeoutError:
            if scope.expired() and self.expired:
                raise StoreExpired from None
            raise

    def _arm(self) -> None:
        if self._timer is None and self._loop is not None and self.deadline_s is not None:
            self._timer = self._loop.call_at(self._quiet_since + self.deadline_s, self._check)

    def _check(self) -> None:
        """The timer: expire the operation if the store stayed quiet for the whole deadline,
        else look again when it would have."""
        assert self._loop is not None and self.deadline_s is not None
        self._timer = None
        if self._pending == 0 or self.expired:
            return
        if self.quiet_s() >= self.deadline_s:
            self.expire()
        else:
            self._arm()

    def expire(self) -> None:
        """The clock ran out: every try in flight stops now, and no request is sent again."""
        if self.expired:
            return
        self.expired = True
        self.expired_after_s = self.quiet_s()
        assert self._loop is not None
        now = self._loop.time()
        for scope in list(self._scopes):
            scope.reschedule(now)
        logger.debug("store operation %s: no answer for %.1f s; its requests stop",
                     self.what, self.expired_after_s)

    # -- what it cost -----------------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        """The counters so far (exact once the operation's requests are over)."""
        waiting_s = self._waiting_s
        if self._pending and self._loop is not None:
            waiting_s += self._loop.time() - self._busy_since
        return StoreStatistics(num_requests=self._num_requests, num_retries=self._num_retries,
                               num_throttled=self._num_throttled,
                               num_lists=self._num_lists,
                               sent_bytes=self._sent_bytes,
                               received_bytes=self._received_bytes, waiting_s=waiting_s)

    def __repr__(self) -> str:
        state = "expired" if self.expired else f"{self._pending} pending"
        return f"<StoreOperation {self.what} {state}: {self.statistics()}>"


@contextlib.contextmanager
def store_operation(what: str, target: str = "") -> Iterator[StoreOperation]:
    """Make every store request in this block (and in the tasks it spawns) one operation
    `what` (of `target`, for the log): one clock, one set of counters, logged at DEBUG at the
    end. Inside another operation, the outer one goes on (a save's reads are the save's).

    What a load asked of the store (a save reports it in `SaveResult.store`):

        with store_operation("load") as operation:
            state = await engine.load("s3://bucket/run")
        operation.statistics()      # StoreStatistics: requests, lists, retries, bytes, wait
    """
    outer = _CURRENT.get()
    if outer is not None:
        yield outer
        return
    operation = StoreOperation(what)
    token = _CURRENT.set(operation)
    try:
        yield operation
    finally:
        _CURRENT.reset(token)
        if operation.statistics().num_requests:
            logger.debug("%s %s: %s", what, target, operation.statistics())


def current_operation(what: str) -> StoreOperation:
    """The operation the caller is in, or a fresh one named `what` for a single request."""
    return _CURRENT.get() or StoreOperation(what)
