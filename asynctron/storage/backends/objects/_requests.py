"""`StoreRequests`: one store's requests run bounded, retried inside a deadline, their
failures as errors that name the endpoint, the object and what to set.

Each request runs on the store I/O loop holding a place in the loop's request budget.
Connection resets, timeouts, 5xx and throttling are retried with exponential backoff and
jitter while the store answers the operation the request is part of (a save, a load, a read:
`store_operation`): one clock for all of its requests, which runs out once the store has
answered none of them for the deadline; then every request of the operation stops. A
throttled request (503, 429) shrinks the request budget's window (`RequestBudget`): the
client slows to the rate the store serves. What retrying cannot fix fails at once: a host
that does not exist, TLS against a plain-HTTP port, wrong credentials; a refused connection
is retried for `REFUSED_GRACE_S` only, unless the store answered before (then it is likely
restarting: the whole deadline).

A cloud's client says what its SDK's errors mean (`StoreErrors`); the transport's (sockets,
DNS, TLS, aiohttp) are read here, once for every cloud.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import socket
import ssl
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import aiohttp

from asynctron._knobs import store_deadline_hint
from asynctron.errors import AsynctronError, StorageError
from asynctron.storage.backends._operation import (
    StoreExpired,
    StoreOperation,
    current_operation,
)
from asynctron.storage.backends.objects._io_loop import on_io_loop
from asynctron.storage.backends.objects._layout import ObjectUrl
from asynctron.storage.backends.objects._request_budget import RequestBudget

logger = logging.getLogger(__name__)
T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

REFUSED_GRACE_S = 5.0
"""How long a refused connection is retried when the store never answered this client: a
wrong port fails in seconds, not after the whole deadline."""
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
_FIRST_BACKOFF_S = 0.05
_LAST_TRY_S = 0.05
"""The last try is sent this long before the deadline at the latest."""
_MAX_BACKOFF_S = 2.0


class Failure(enum.Enum):
    """What a failed try says about trying again."""

    FINAL = "final"
    """Trying again cannot help (a bad request, wrong credentials, a host that does not
    exist, TLS against a plain port)."""
    ANSWERED = "answered"
    """The store answered, and the answer is final (no such object, a failed condition)."""
    TRANSIENT = "transient"
    """A reset, a timeout, a 5xx: the store may answer the next try."""
    THROTTLED = "throttled"
    """The store asked us to slow down (503, 429)."""
    REFUSED = "refused"
    """Nothing listens at the endpoint: a store restarting, or a wrong port."""


@dataclass(frozen=True, slots=True)
class Answer:
    """A failed request's answer from the store, as its SDK reported it."""

    failure: Failure
    status: int | None
    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.message != self.code else self.code


class StoreErrors(Protocol):
    """What one cloud's SDK errors mean."""

    transport_errors: tuple[type[BaseException], ...]
    """The SDK's own errors for a connection that failed (retried as a reset is)."""
    endpoint_hint: str
    """What sets the endpoint, as errors name it: `AWS_ENDPOINT_URL (or S3Config...)`."""
    deadline_hint: str
    """What sets the deadline, as errors name it (`_knobs.store_deadline_hint`'s default)."""

    def answer_of(self, error: Exception) -> Answer | None:
        """`error` as an answer of the store, or None if it is none (a transport error)."""

    def translate(self, where: str, url: ObjectUrl | str, answer: Answer) -> StorageError:
        """The error for a final answer of the store (FINAL or ANSWERED), `where` naming the
        request, the object and the endpoint."""


class StoreRequests:
    """Runs the requests of one client: `retried`. Concurrency: any number of tasks on any
    loops (each request runs on the I/O loop, in that loop's budget)."""

    def __init__(self, endpoint: str, errors: StoreErrors, *, deadline_s: float,
                 max_in_flight: Callable[[], int]) -> None:
        self.endpoint = endpoint
        self.deadline_s = deadline_s
        self._errors = errors
        self._max_in_flight = max_in_flight
        self._budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, RequestBudget] = (
            weakref.WeakKeyDictionary())
        self._answered = False
        """Whether the store answered yet (a refused connection is then likely a restart,
        retried to the deadline)."""

    @property
    def most_in_flight(self) -> int:
        """The most requests in flight at once (0 before any)."""
        return max((budget.most_in_flight for budget in list(self._budgets.values())),
                   default=0)

    def budget(self) -> RequestBudget:
        """The request budget of the running loop (the I/O loop's, for requests)."""
        loop = asyncio.get_running_loop()
        found = self._budgets.get(loop)
        if found is None:
            found = self._budgets[loop] = RequestBudget(self._max_in_flight())
        return found

    async def retried(self, operation: str, url: ObjectUrl | str,
                      attempt: Callable[[], Awaitable[T]], *, sent_bytes: int = 0,
                      received_bytes: int | Callable[[T], int] = 0) -> T:
        """`attempt()` on the I/O loop, holding a request slot, retried on transient
        failures while the caller's store operation (`store_operation`; else this request
        alone) has heard from the store within the deadline. `sent_bytes`/`received_bytes`
        (or a function of the result): what the request moves, for the statistics.

        Raises:
            ObjectNotFoundError: the object or bucket does not exist.
            PreconditionFailedError: a conditional request's condition failed.
            StorageError: any other failure, naming endpoint, object and what to set.

        Cancellation: the request is cancelled on the I/O loop, and this returns (raising
        CancelledError) only once it has stopped."""
        return await on_io_loop(self._retried(operation, url, attempt,
                                              current_operation(operation),
                                              sent_bytes, received_bytes))

    async def _retried(self, operation: str, url: ObjectUrl | str,
                       attempt: Callable[[], Awaitable[T]], clock: StoreOperation,
                       sent_bytes: int, received_bytes: int | Callable[[T], int]) -> T:
        deadline_s = self.deadline_s
        clock.begin(deadline_s)
        tries = 0
        try:
            while True:
                tries += 1
                slowed = False  # this try's throttling cut the budget's window
                try:
                    async with clock.watch():
                        budget = self.budget()
                        async with budget.slot() as slot:
                            clock.count_try(retry=tries > 1,
                                            listing=operation.startswith("list"))
                            try:
                                result = await attempt()
                            except Exception as error:
                                if self.failure_of(error) is Failure.THROTTLED:
                                    slowed = budget.throttled(slot)  # before the slot frees
                                raise
                            budget.answered(slot)
                except StoreExpired as expired:
                    raise self._expired(operation, url, clock, tries) from expired
                except AsynctronError:
                    clock.answered()
                    raise  # ours (an object shorter than its manifest says): final
                except Exception as error:
                    failure = self.failure_of(error)
                    if failure is Failure.THROTTLED:
                        clock.count_throttled()
                    if failure is Failure.REFUSED and not self._answered and (
                            clock.quiet_s() >= min(REFUSED_GRACE_S, deadline_s)):
                        failure = Failure.FINAL  # nothing ever listened there
                    if failure in (Failure.FINAL, Failure.ANSWERED):
                        if failure is Failure.ANSWERED:
                            self._answered = True
                            clock.answered()
                        raise self._translate(operation, url, error, clock,
                                              tries) from error
                    backoff = min(_MAX_BACKOFF_S,
                                  _FIRST_BACKOFF_S * 2 ** min(tries - 1, 8))
                    backoff *= random.uniform(0.5, 1.0)
                    if slowed:
                        backoff = 0.0  # the smaller window slows the client down
                    left_s = deadline_s - clock.quiet_s() - _LAST_TRY_S
                    if left_s <= 0:
                        clock.expire()
                        raise self._translate(operation, url, error, clock,
                                              tries) from error
                    backoff = min(backoff, left_s)  # a last try just before the deadline
                    logger.debug("%s %s: %s; retrying in %.2f s", operation, url, error,
                                 backoff)
                    await asyncio.sleep(backoff)
                    if clock.expired:
                        raise self._expired(operation, url, clock, tries,
                                            error) from error
                else:
                    self._answered = True
                    clock.answered(sent_bytes=sent_bytes, received_bytes=(
                        received_bytes(result) if callable(received_bytes) else received_bytes))
                    return result
        finally:
            clock.end()

    def failure_of(self, error: Exception) -> Failure:
        """What `error` says about trying again: the store's answer, else the transport's."""
        answer = self._errors.answer_of(error)
        if answer is not None:
            return answer.failure
        if caused_by(error, ssl.SSLError):
            return Failure.FINAL
        dns = cause(error, socket.gaierror)
        if dns is not None:
            return Failure.TRANSIENT if dns.errno == socket.EAI_AGAIN else Failure.FINAL
        if caused_by(error, ConnectionRefusedError):
            return Failure.REFUSED
        transport = _TRANSPORT_ERRORS + self._errors.transport_errors
        return Failure.TRANSIENT if isinstance(error, transport) else Failure.FINAL

    def _expired(self, operation: str, url: ObjectUrl | str, clock: StoreOperation,
                 tries: int, last: Exception | None = None) -> StorageError:
        """The error of a request whose operation's clock ran out (on it or another)."""
        waited_s = clock.expired_after_s if clock.expired else clock.quiet_s()
        what = f"; last: {type(last).__name__}: {last}" if last is not None else ""
        return StorageError(
            f"{operation} {url} at {self.endpoint}: the store answered none of this "
            f"{clock.what}'s requests for {waited_s:.1f} s ({_tries(tries)} of this one{what}); "
            f"is the store up, and {self._errors.endpoint_hint} right? {self._deadline_hint()}",
            path=str(url), errno=None)

    def _deadline_hint(self) -> str:
        """How to wait longer, and the deadline now."""
        return (f"{store_deadline_hint(self._errors.deadline_hint)} "
                f"(now {self.deadline_s:g} s)")

    def _translate(self, operation: str, url: ObjectUrl | str, error: Exception,
                   clock: StoreOperation, tries: int) -> StorageError:
        where = f"{operation} {url} at {self.endpoint}"
        failure = self.failure_of(error)
        answer = self._errors.answer_of(error)
        if answer is not None:
            if failure in (Failure.THROTTLED, Failure.TRANSIENT):
                return StorageError(
                    f"{where}: the store kept failing this {clock.what}'s requests ({answer}) "
                    f"for {clock.quiet_s():.1f} s ({_tries(tries)} of this one); "
                    f"{self._deadline_hint()}",
                    path=str(url), errno=None)
            return self._errors.translate(where, url, answer)
        host = urllib.parse.urlsplit(self.endpoint).netloc or self.endpoint
        if caused_by(error, ssl.SSLError):
            return StorageError(
                f"{where}: the TLS handshake with {host} failed ({root_cause(error)}); if the "
                "store serves plain HTTP on that port, make the endpoint URL http://, else "
                "check its certificate", path=str(url), errno=None)
        if caused_by(error, socket.gaierror) and failure is Failure.FINAL:
            return StorageError(
                f"{where}: the host {host!r} was not found ({root_cause(error)}); fix the "
                f"endpoint's host in {self._errors.endpoint_hint}", path=str(url), errno=None)
        if caused_by(error, ConnectionRefusedError):
            return StorageError(
                f"{where}: connection refused for {clock.quiet_s():.1f} s ({_tries(tries)}): "
                f"nothing listens at {host}; is the store up, and the port in "
                f"{self._errors.endpoint_hint} its port?", path=str(url), errno=None)
        if failure is Failure.TRANSIENT:
            return self._expired(operation, url, clock, tries, error)
        return StorageError(f"{where}: {type(error).__name__}: {error}", path=str(url),
                            errno=None)


def cause(error: BaseException, kind: type[E]) -> E | None:
    """The first error of type `kind` in `error`'s chain of causes, or None."""
    seen: set[int] = set()
    found: BaseException | None = error
    while found is not None and id(found) not in seen:
        if isinstance(found, kind):
            return found
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return None


def caused_by(error: BaseException, kind: type[BaseException]) -> bool:
    return cause(error, kind) is not None


def root_cause(error: BaseException) -> str:
    """The innermost error of `error`'s chain, as one line."""
    seen: set[int] = set()
    while (error.__cause__ or error.__context__) is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return f"{type(error).__name__}: {error}"


def _tries(tries: int) -> str:
    return "1 try" if tries == 1 else f"{tries} tries"

