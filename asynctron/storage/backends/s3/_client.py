"""`S3Client`: S3 requests, asyncio-native, bounded, retried inside a deadline, their failures
as errors that name the endpoint, the object and what to set.

Requests run on the process's S3 I/O loop, a uvloop on a thread of its own (`io_loop`): every
byte a request sends or receives is handled there, so the caller's loop (a trainer's) only
awaits each request's outcome and its heartbeat never waits on a socket copy; a cancelled
caller waits until its request is cancelled there, so no buffer it lends is touched after.
One aiobotocore client per store on that loop, made on first use, closed at exit; ranged
GETs go to each object's presigned URL through `RangeClient` (the body lands in the caller's
buffers, no copy on the loop). Every
request holds a place in the request budget (at most `S3Config.max_requests`) while in
flight.

Connection resets, timeouts, 5xx, SlowDown and 429 are retried with exponential backoff and
jitter while the store answers the operation the request is part of (a save, a load, a read:
`store_operation`): one clock for all of its requests, which runs out once the store has
answered none of them for `S3Config.deadline_s`; then every request of the operation stops.
botocore's own retries are off, so that clock is the only one. A throttled request (503
SlowDown, 429) shrinks the request budget's window (`RequestBudget`): the client slows to
the rate the store serves, and grows back while the store keeps answering. What retrying
cannot fix fails at once: a host that does not exist, TLS against a plain-HTTP port, wrong
credentials, an endpoint that is not S3; a refused connection is retried for
`REFUSED_GRACE_S` only, unless the store answered this client before (then it is likely
restarting: the whole deadline).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import enum
import io
import logging
import os
import random
import re
import socket
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp
import aiohttp.abc
import aiohttp.payload
import botocore.exceptions
import numpy as np
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from asynctron._concurrency import uncancellable
from asynctron._loop_thread import LoopThread
from asynctron.errors import (
    AsynctronError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StorageError,
)
from asynctron.storage.backends._http_ranges import RangeClient
from asynctron.storage.backends._operation import (
    StoreExpired,
    StoreOperation,
    current_operation,
)
from asynctron.storage.backends._request_budget import RequestBudget
from asynctron.storage.backends.s3._config import S3Config
from asynctron.storage.backends.s3._layout import ObjectUrl
from asynctron.storage.backends.s3._service_models import use_service_model_loader

logger = logging.getLogger(__name__)
T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

PRESIGNED_S = 3600
"""How long a presigned GET URL is valid (one is made again at half of it)."""
_MOST_PRESIGNED = 4096
"""Presigned URLs kept per client (all are dropped beyond it)."""
REFUSED_GRACE_S = 5.0
"""How long a refused connection is retried when the store never answered this client: a
wrong port fails in seconds, not after the whole deadline."""
_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
    "503", "429"})
_RETRIED_CODES = frozenset({
    "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "500",
    "502", "504"})
_ANSWER_HAS_BODY = frozenset({"list_objects_v2", "get_object", "list_multipart_uploads"})
"""Requests whose 404 carries an S3 error document (`NoSuchKey`, `NoSuchBucket`) from a real
store: a bare 404 there comes from something that is not S3."""
_DEADLINE_HINT = ("raise S3Config.deadline_s (or ASYNCTRON_STORE_DEADLINE_S) to wait longer")
_CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
    "ExpiredToken", "403"})
_TRANSPORT_ERRORS = (
    botocore.exceptions.HTTPClientError,  # connection closed or reset, timeouts, proxies
    botocore.exceptions.ConnectionError,  # connection refused, DNS
    botocore.exceptions.ResponseStreamingError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
)
_SEND_SLICE_BYTES = 256 << 10
_PAGE_BYTES = 4096
_FIRST_BACKOFF_S = 0.05
_LAST_TRY_S = 0.05
"""The last try is sent this long before the deadline at the latest."""
_MAX_BACKOFF_S = 2.0
_SET_CREDENTIALS = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
                    "S3Config(access_key_id=..., secret_access_key=...)")


class _BufferPayload(aiohttp.payload.BytesPayload):
    """A request body sent from the buffer where it lies, in slices of `_SEND_SLICE_BYTES`,
    each handed to the transport once it has taken the one before (aiohttp drains between
    writes). So the loop copies nothing and never waits long: given a whole part at once, the
    transport would copy what the socket did not take, tens of MiB, on the loop thread."""

    def __init__(self, value: memoryview) -> None:
        aiohttp.payload.Payload.__init__(self, value, content_type="application/octet-stream")
        self._size = value.nbytes

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: aiohttp.abc.AbstractStreamWriter,
                                content_length: int | None) -> None:
        view = self._value if content_length is None else self._value[:content_length]
        for start in range(0, view.nbytes, _SEND_SLICE_BYTES):
            await writer.write(view[start:start + _SEND_SLICE_BYTES])


class PreconditionFailedError(StorageError):
    """A conditional write found the object not as required (it exists, or changed)."""


class RefusedCredentialsError(StorageError):
    """The store refused the request's credentials (or its signature)."""


class _LoopClient:
    """An aiobotocore client, a client for presigned GETs and the request budget of one
    event loop."""

    def __init__(self, client: Any, config: S3Config) -> None:
        self.client = client
        self.budget = RequestBudget(config.process_requests(_world_size()))
        self.ranges = RangeClient(connect_timeout_s=config.connect_timeout_s,
                                  read_timeout_s=config.read_timeout_s)
        self.presigned: dict[ObjectUrl, tuple[str, float]] = {}
        """Each object's presigned GET URL, and when it was made."""

    async def presigned_url(self, url: ObjectUrl) -> str:
        """`url`'s presigned GET URL, made again when half its life is gone."""
        found = self.presigned.get(url)
        now = time.monotonic()
        if found is None or now - found[1] > PRESIGNED_S / 2:
            if len(self.presigned) >= _MOST_PRESIGNED:
                self.presigned.clear()
            found = self.presigned[url] = (await self.client.generate_presigned_url(
                "get_object", Params={"Bucket": url.bucket, "Key": url.key},
                ExpiresIn=PRESIGNED_S), now)
        return found[0]

    async def aclose(self) -> None:
        await self.ranges.aclose()
        await self.client.__aexit__(None, None, None)


class S3Client:
    """Requests to one store, from any number of event loops and threads (each runs on the
    S3 I/O loop; a forked child gets a client of its own).

    Concurrency: any number of tasks on a loop share its client and its request budget.
    """

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.endpoint = config.resolved_endpoint() or "AWS S3"
        self._session = AioSession(profile=config.profile)
        use_service_model_loader(self._session)
        self._answered = False
        """Whether the store answered this client yet (a refused connection is then likely a
        restart, retried to the deadline)."""
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClient] = (
            weakref.WeakKeyDictionary())
        self._opening: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary())
        _CLIENTS.add(self)
        weakref.finalize(self, _close_when_collected, self._clients)

    def _region(self) -> str:
        return (self.config.region or os.environ.get("AWS_REGION")
                or self._session.get_config_variable("region") or "us-east-1")

    async def _loop_client(self) -> _LoopClient:
        loop = asyncio.get_running_loop()
        found = self._clients.get(loop)
        if found is not None:
            return found
        lock = self._opening.setdefault(loop, asyncio.Lock())
        async with lock:
            found = self._clients.get(loop)
            if found is None:
                found = self._clients[loop] = _LoopClient(await self._open_client(),
                                                          self.config)
        return found

    async def _open_client(self) -> Any:
        config = self.config
        checksums = "when_supported" if config.store_checksums else "when_required"
        client_config = AioConfig(
            s3={"addressing_style": config.resolved_addressing_style(),
                "payload_signing_enabled": config.sign_payload},
            request_checksum_calculation=checksums, response_checksum_validation=checksums,
            retries={"total_max_attempts": 1}, max_pool_connections=config.max_requests,
            connect_timeout=config.connect_timeout_s, read_timeout=config.read_timeout_s,
            tcp_keepalive=True, parameter_validation=False)
        creator = self._session.create_client(
            "s3", region_name=self._region(), endpoint_url=config.endpoint_url,
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            aws_session_token=config.session_token, config=client_config)
        return await creator.__aenter__()

    def body(self, buffer: memoryview | bytes) -> dict[str, Any]:
        """The `Body` and `ContentLength` parameters that send `buffer`: as it lies, unless
        the config hashes payloads (`sign_payload`, `store_checksums`): then a copy botocore
        can read, hashed on the loop thread (the cost those options carry)."""
        view = memoryview(buffer).cast("B")
        if self.config.sign_payload or self.config.store_checksums:
            return {"Body": io.BytesIO(view), "ContentLength": view.nbytes}
        return {"Body": _BufferPayload(view), "ContentLength": view.nbytes}

    @property
    def most_in_flight(self) -> int:
        """The most requests this client had in flight at once (0 before any)."""
        return max((found.budget.most_in_flight for found in list(self._clients.values())),
                   default=0)

    async def call(self, operation: str, url: ObjectUrl | str, /, **params: Any) -> Any:
        """`operation` (a client method: `put_object`, `upload_part`, ...) with `params`,
        retried inside the deadline; `url` names the object in errors.

        Raises:
            ObjectNotFoundError: the object or bucket does not exist (404).
            PreconditionFailedError: a conditional write's condition failed (412).
            StorageError: any other failure, naming endpoint, object and what to set.
        """
        async def attempt(client: Any) -> Any:
            return await getattr(client, operation)(**params)

        return await self.retried(operation, url, attempt,
                                  sent_bytes=params.get("ContentLength", 0))

    async def get_small(self, url: ObjectUrl, max_bytes: int) -> tuple[bytes | None, str, int]:
        """The whole object `url` if it holds at most `max_bytes` (else None, unread), its
        ETag and its size.

        Raises:
            ObjectNotFoundError, StorageError: as `call`.
        """
        async def attempt(client: Any) -> tuple[bytes | None, str, int]:
            response = await client.get_object(Bucket=url.bucket, Key=url.key)
            async with response["Body"] as body:
                size = response.get("ContentLength", 0)
                data = await body.read() if size <= max_bytes else None
            return data, response.get("ETag", ""), size

        return await self.retried("get_object", url, attempt,
                                  received_bytes=lambda found: len(found[0] or b""))

    async def get_into(self, url: ObjectUrl, offset: int, buffers: Sequence[memoryview],
                       *, key: str | None = None, if_match: str | None = None) -> None:
        """Fill `buffers`, one after another, with the object's bytes from `offset`: one
        ranged GET of the object's presigned URL (signed once per object, then a plain HTTP
        request whose body the kernel copies straight into the buffers), retried whole inside
        the deadline; with `if_match`, only from the version whose ETag it is.

        Raises:
            CorruptCheckpointError: the object ends before the buffers are full (names `key`,
                the item being read; without one, a StorageError).
            ObjectNotFoundError, PreconditionFailedError, StorageError: as `call`.
        """
        nbytes = sum(buffer.nbytes for buffer in buffers)
        if not nbytes:
            return
        headers = {"Range": f"bytes={offset}-{offset + nbytes - 1}"}
        if if_match is not None:
            headers["If-Match"] = if_match

        async def attempt(_: Any) -> None:
            found = await self._loop_client()
            answer = await found.ranges.get_into(await found.presigned_url(url), headers,
                                                 buffers)
            if answer.status not in (200, 206):
                raise _client_error(answer.status, answer.body)
            if answer.status == 200 and (answer.content_length or 0) > nbytes:
                raise StorageError(
                    f"get_object {url} at {self.endpoint}: asked for bytes [{offset}, "
                    f"+{nbytes}), sent {answer.content_length}: the store ignored the range",
                    path=str(url), errno=None)
            if answer.received < nbytes:
                message = (f"object {url}: expected {nbytes} bytes from offset {offset}, "
                           f"found {answer.received}")
                if key is None:
                    raise StorageError(message, path=str(url), errno=None)
                raise CorruptCheckpointError(
                    f"{message}; the object is shorter than its manifest says (truncated or "
                    "replaced after commit)", path=str(url), key=key,
                    offset=offset + answer.received)

        try:
            await self.retried("get_object", url, attempt, received_bytes=nbytes)
        except RefusedCredentialsError:  # signed by credentials since rotated: once more
            await on_io_loop(self._forget_presigned(url))
            await self.retried("get_object", url, attempt, received_bytes=nbytes)

    async def _forget_presigned(self, url: ObjectUrl) -> None:
        found = self._clients.get(asyncio.get_running_loop())
        if found is not None:
            found.presigned.pop(url, None)

    async def retried(self, operation: str, url: ObjectUrl | str,
                      attempt: Callable[[Any], Awaitable[T]], *, sent_bytes: int = 0,
                      received_bytes: int | Callable[[T], int] = 0) -> T:
        """`attempt(client)` on the I/O loop, holding a request slot, retried on transient
        failures while the caller's store operation (`store_operation`; else this request
        alone) has heard from the store within `deadline_s`; failures translated as `call`
        says. `sent_bytes`/`received_bytes` (or a function of the result): what the request
        moves, for the operation's statistics.

        Cancellation: the request is cancelled on the I/O loop, and this returns (raising
        CancelledError) only once it has stopped."""
        return await on_io_loop(self._retried(operation, url, attempt,
                                              current_operation(operation),
                                              sent_bytes, received_bytes))

    async def _retried(self, operation: str, url: ObjectUrl | str,
                       attempt: Callable[[Any], Awaitable[T]], clock: StoreOperation,
                       sent_bytes: int, received_bytes: int | Callable[[T], int]) -> T:
        deadline_s = self.config.deadline_s
        clock.begin(deadline_s)
        tries = 0
        try:
            while True:
                tries += 1
                slowed = False  # this try's throttling cut the budget's window
                try:
                    async with clock.watch():
                        loop_client = await self._loop_client()
                        budget = loop_client.budget
                        async with budget.slot() as slot:
                            clock.count_try(retry=tries > 1,
                                            listing=operation.startswith("list_"))
                            try:
                                result = await attempt(loop_client.client)
                            except Exception as error:
                                if _failure_of(error) is _Failure.THROTTLED:
                                    slowed = budget.throttled(slot)  # before the slot frees
                                raise
                            budget.answered(slot)
                except StoreExpired as expired:
                    raise self._expired(operation, url, clock, tries) from expired
                except AsynctronError:
                    clock.answered()
                    raise  # ours (an object shorter than its manifest says): final
                except Exception as error:
                    failure = _failure_of(error)
                    if failure is _Failure.THROTTLED:
                        clock.count_throttled()
                    if failure is _Failure.REFUSED and not self._answered and (
                            clock.quiet_s() >= min(REFUSED_GRACE_S, deadline_s)):
                        failure = _Failure.FINAL  # nothing ever listened there
                    if failure in (_Failure.FINAL, _Failure.ANSWERED):
                        if failure is _Failure.ANSWERED:
                            self._answered = True
                            clock.answered()
                        raise self._translate(operation, url, error, clock,
                                              tries) from error
                    backoff = min(_MAX_BACKOFF_S, _FIRST_BACKOFF_S * 2 ** min(tries - 1, 8))
                    backoff *= random.uniform(0.5, 1.0)
                    if slowed:
                        backoff = 0.0  # the smaller window slows the client down
                    left_s = deadline_s - clock.quiet_s() - _LAST_TRY_S
                    if left_s <= 0:
                        clock.expire()
                        raise self._translate(operation, url, error, clock, tries) from error
                    backoff = min(backoff, left_s)  # a last try just before the deadline
                    logger.debug("%s %s: %s; retrying in %.2f s", operation, url, error,
                                 backoff)
                    await asyncio.sleep(backoff)
                    if clock.expired:
                        raise self._expired(operation, url, clock, tries, error) from error
                else:
                    self._answered = True
                    clock.answered(sent_bytes=sent_bytes, received_bytes=(
                        received_bytes(result) if callable(received_bytes) else received_bytes))
                    return result
        finally:
            clock.end()

    def _expired(self, operation: str, url: ObjectUrl | str, clock: StoreOperation,
                 tries: int, last: Exception | None = None) -> StorageError:
        """The error of a request whose operation's clock ran out (on it or another)."""
        waited_s = clock.expired_after_s if clock.expired else clock.quiet_s()
        what = f"; last: {type(last).__name__}: {last}" if last is not None else ""
        return StorageError(
            f"{operation} {url} at {self.endpoint}: the store answered none of this "
            f"{clock.what}'s requests for {waited_s:.1f} s ({_tries(tries)} of this one{what}); "
            "is the store up, and AWS_ENDPOINT_URL (or S3Config.endpoint_url) right? "
            f"{_DEADLINE_HINT} (now {self.config.deadline_s:g} s)", path=str(url), errno=None)

    def _translate(self, operation: str, url: ObjectUrl | str, error: Exception,
                   clock: StoreOperation, tries: int) -> StorageError:
        where = f"{operation} {url} at {self.endpoint}"
        if isinstance(error, botocore.exceptions.NoCredentialsError | (
                botocore.exceptions.PartialCredentialsError)):
            return StorageError(f"{where}: no credentials found ({error}); {_SET_CREDENTIALS}",
                                path=str(url), errno=None)
        if isinstance(error, botocore.exceptions.ClientError):
            info = error.response.get("Error", {})
            code = str(info.get("Code", ""))
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            message = info.get("Message") or code
            if code == "NoSuchBucket":
                bucket = url.bucket if isinstance(url, ObjectUrl) else url
                return ObjectNotFoundError(
                    f"{where}: the bucket {bucket!r} does not exist; create it, or fix the "
                    "URL's bucket (and AWS_ENDPOINT_URL if this is the wrong store)",
                    path=str(url), errno=None)
            if code == "404" and operation in _ANSWER_HAS_BODY:
                return ObjectNotFoundError(
                    f"{where}: the endpoint answered 404 without an S3 error document; is "
                    f"{self.endpoint} an S3 endpoint (not a web, admin or filer port)? Fix "
                    "AWS_ENDPOINT_URL (or S3Config.endpoint_url)", path=str(url), errno=None)
            if code in ("NoSuchKey", "NoSuchUpload", "404") or status == 404:
                return ObjectNotFoundError(f"{where}: no such object ({code})", path=str(url),
                                         errno=None)
            if code == "PreconditionFailed" or status == 412:
                return PreconditionFailedError(f"{where}: the condition failed ({message})",
                                               path=str(url), errno=None)
            if code in _CREDENTIAL_CODES:
                return RefusedCredentialsError(
                    f"{where}: the store refused our credentials ({code}: {message}); "
                    f"{_SET_CREDENTIALS}", path=str(url), errno=None)
            if status in (405, 501):
                return StorageError(
                    f"{where}: the endpoint does not implement this request ({status}: "
                    f"{message}); is {self.endpoint} an S3 endpoint? Fix AWS_ENDPOINT_URL (or "
                    "S3Config.endpoint_url)", path=str(url), errno=None)
            if _failure_of(error) in (_Failure.THROTTLED, _Failure.TRANSIENT):
                return StorageError(
                    f"{where}: the store kept failing this {clock.what}'s requests ({code}: "
                    f"{message}) for {clock.quiet_s():.1f} s ({_tries(tries)} of this one); "
                    f"{_DEADLINE_HINT} (now {self.config.deadline_s:g} s)", path=str(url),
                    errno=None)
            return StorageError(f"{where}: {code}: {message}", path=str(url), errno=None)
        host = _host_of(self.endpoint)
        if _caused_by(error, ssl.SSLError):
            return StorageError(
                f"{where}: the TLS handshake with {host} failed ({_root_cause(error)}); if the "
                "store serves plain HTTP on that port, make the endpoint URL http://, else "
                "check its certificate (AWS_CA_BUNDLE)", path=str(url), errno=None)
        if _caused_by(error, socket.gaierror) and _failure_of(error) is _Failure.FINAL:
            return StorageError(
                f"{where}: the host {host!r} was not found ({_root_cause(error)}); fix the "
                "endpoint's host in AWS_ENDPOINT_URL (or S3Config.endpoint_url)",
                path=str(url), errno=None)
        if _caused_by(error, ConnectionRefusedError):
            return StorageError(
                f"{where}: connection refused for {clock.quiet_s():.1f} s ({_tries(tries)}): "
                f"nothing listens at {host}; is the store up, and the port in "
                "AWS_ENDPOINT_URL (or S3Config.endpoint_url) its S3 port?", path=str(url),
                errno=None)
        if _failure_of(error) is _Failure.TRANSIENT:
            return self._expired(operation, url, clock, tries, error)
        return StorageError(f"{where}: {type(error).__name__}: {error}", path=str(url),
                            errno=None)

    async def aclose(self) -> None:
        """On the I/O loop: close its client (its connections)."""
        found = self._clients.pop(asyncio.get_running_loop(), None)
        if found is not None:
            await found.aclose()


_IO_LOCK = threading.Lock()
_IO: tuple[int, LoopThread] | None = None
"""The process's S3 I/O loop, and the pid that started it (a forked child starts its own)."""
_CLIENTS: weakref.WeakSet[S3Client] = weakref.WeakSet()


def io_loop() -> LoopThread:
    """The process's S3 I/O loop, started on first use."""
    global _IO
    with _IO_LOCK:
        if _IO is None or _IO[0] != os.getpid():
            _IO = (os.getpid(), LoopThread("asynctron-s3-io"))
        return _IO[1]


async def on_io_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` on the S3 I/O loop (directly, if already on it) and return its
    outcome. If the caller is cancelled, the coroutine is cancelled there and this waits
    until it has stopped, then raises CancelledError."""
    io = io_loop()
    caller = asyncio.get_running_loop()
    if caller is io.loop:
        return await coroutine
    outcome: asyncio.Future[T] = caller.create_future()
    started: concurrent.futures.Future[asyncio.Task[T]] = concurrent.futures.Future()

    def start() -> None:  # on the I/O loop
        task = io.loop.create_task(coroutine)
        task.add_done_callback(lambda done: caller.call_soon_threadsafe(_settle, outcome, done))
        started.set_result(task)

    io.loop.call_soon_threadsafe(start)
    try:
        return await asyncio.shield(outcome)
    except asyncio.CancelledError:
        if not outcome.done():
            io.loop.call_soon_threadsafe(started.result().cancel)
            await uncancellable(outcome)
        raise


def _close_when_collected(clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                                            _LoopClient]) -> None:
    """An `S3Client` was collected: close its clients on their loops (from any thread)."""
    for loop, found in list(clients.items()):
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                asyncio.run_coroutine_threadsafe(found.aclose(), loop)


def _settle(outcome: asyncio.Future[T], task: asyncio.Task[T]) -> None:
    """On the caller's loop: pass the I/O loop task's outcome on."""
    if outcome.done():
        return
    if task.cancelled():
        outcome.cancel()
    elif task.exception() is not None:
        outcome.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        outcome.set_result(task.result())


@atexit.register
def _close_io_loop() -> None:
    """Close the clients on the I/O loop and stop it (no connection left for the collector)."""
    with _IO_LOCK:
        found = _IO
    if found is None or found[0] != os.getpid():
        return
    io = found[1]
    clients = list(_CLIENTS)

    async def close() -> None:
        for client in clients:
            await client.aclose()

    with contextlib.suppress(Exception):
        io.submit(close()).result(timeout=5)
    io.stop()


def _world_size() -> int:
    """How many processes the job has: torch.distributed's world, else torchrun's
    `WORLD_SIZE`, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    text = os.environ.get("WORLD_SIZE", "")
    return int(text) if text.isdigit() and int(text) > 0 else 1


def touch_pages(buffers: Sequence[memoryview]) -> None:
    """Blocks: write one byte per page of each buffer (whose bytes are about to be read into
    it), so the first touch of fresh pages (several times a warm write on a VM) happens here,
    on the executor, not in the loop's copies."""
    for buffer in buffers:
        if buffer.nbytes >= _PAGE_BYTES and not buffer.readonly:
            array = np.frombuffer(buffer.cast("B") if buffer.format != "B" else buffer,
                                  dtype=np.uint8)
            array[::_PAGE_BYTES] = 0  # its bytes are about to be overwritten


def _client_error(status: int, body: bytes) -> botocore.exceptions.ClientError:
    """A failed plain GET as botocore reports one (the S3 error document's code and message),
    so it is retried and translated like any request."""
    text = body.decode("utf-8", "replace")
    code = re.search(r"<Code>([^<]*)</Code>", text)
    message = re.search(r"<Message>([^<]*)</Message>", text)
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code[1] if code else str(status),
                   "Message": message[1] if message else text[:200]},
         "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


class _Failure(enum.Enum):
    """What a failed try says about trying again."""

    FINAL = "final"
    """Trying again cannot help (a bad request, wrong credentials, a host that does not
    exist, TLS against a plain port)."""
    ANSWERED = "answered"
    """The store answered, and the answer is final (no such object, a failed condition)."""
    TRANSIENT = "transient"
    """A reset, a timeout, a 5xx: the store may answer the next try."""
    THROTTLED = "throttled"
    """The store asked us to slow down (503 SlowDown, 429)."""
    REFUSED = "refused"
    """Nothing listens at the endpoint: a store restarting, or a wrong port."""


def _failure_of(error: Exception) -> _Failure:
    if isinstance(error, botocore.exceptions.ClientError):
        info = error.response.get("Error", {})
        code = str(info.get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if code in _THROTTLE_CODES or status in (429, 503):
            return _Failure.THROTTLED
        if code in _RETRIED_CODES or (status >= 500 and status != 501):
            return _Failure.TRANSIENT
        return _Failure.ANSWERED if status else _Failure.FINAL
    if _caused_by(error, ssl.SSLError):
        return _Failure.FINAL
    dns = _cause(error, socket.gaierror)
    if dns is not None:
        return _Failure.TRANSIENT if dns.errno == socket.EAI_AGAIN else _Failure.FINAL
    if _caused_by(error, ConnectionRefusedError):
        return _Failure.REFUSED
    return _Failure.TRANSIENT if isinstance(error, _TRANSPORT_ERRORS) else _Failure.FINAL


def _cause(error: BaseException, kind: type[E]) -> E | None:
    """The first error of type `kind` in `error`'s chain of causes, or None."""
    seen: set[int] = set()
    found: BaseException | None = error
    while found is not None and id(found) not in seen:
        if isinstance(found, kind):
            return found
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return None


def _caused_by(error: BaseException, kind: type[BaseException]) -> bool:
    return _cause(error, kind) is not None


def _root_cause(error: BaseException) -> str:
    """The innermost error of `error`'s chain, as one line."""
    seen: set[int] = set()
    while (error.__cause__ or error.__context__) is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return f"{type(error).__name__}: {error}"


def _tries(tries: int) -> str:
    return "1 try" if tries == 1 else f"{tries} tries"


def _host_of(endpoint: str) -> str:
    """`host:port` of an endpoint URL (the URL itself if it has none)."""
    return urllib.parse.urlsplit(endpoint).netloc or endpoint
