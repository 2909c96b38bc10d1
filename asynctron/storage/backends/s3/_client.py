"""`S3Client`: the `ObjectClient` of S3-compatible stores, on aiobotocore.

One aiobotocore client per loop (the store I/O loop's), made on first use, closed at exit;
ranged GETs go to each object's presigned URL through `RangeClient` (the body lands in the
caller's buffers, no copy on the loop). botocore's own retries are off: `StoreRequests`
retries inside the operation's deadline, and `S3Errors` says what S3's answers mean:
SlowDown and 429 throttle, 5xx is transient, NoSuchKey and NoSuchBucket are missing objects,
412 a failed condition, a bare 404 or 405 an endpoint that is not S3.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import io
import os
from collections.abc import Sequence
from typing import Any, TypeVar

import aiohttp
import aiohttp.abc
import aiohttp.payload
import botocore.exceptions
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from asynctron.errors import ObjectNotFoundError, RefusedCredentialsError, StorageError
from asynctron.storage.backends.objects._client import (
    ObjectInfo,
    OpenUpload,
    PartLimits,
    PreconditionFailedError,
)
from asynctron.storage.backends.objects._cloud_client import CloudClient
from asynctron.storage.backends.objects._http_ranges import RangeClient
from asynctron.storage.backends.objects._io_loop import on_io_loop
from asynctron.storage.backends.objects._layout import Listing, ObjectUrl
from asynctron.storage.backends.objects._requests import Answer, Failure
from asynctron.storage.backends.objects._signed_gets import (
    SignedUrls,
    error_document,
    signed_get_into,
)
from asynctron.storage.backends.s3._config import S3Config
from asynctron.storage.backends.s3._service_models import use_service_model_loader

T = TypeVar("T")

MiB = 1 << 20
S3_PART_LIMITS = PartLimits(min_part_bytes=5 * MiB, max_parts=10_000)
"""S3's own bounds on a multipart upload's parts."""
PRESIGNED_S = 3600
"""How long a presigned GET URL is valid (one is made again at half of it)."""
_DELETE_BATCH = 1000
_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
    "503", "429"})
_RETRIED_CODES = frozenset({
    "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "500",
    "502", "504"})
_ANSWER_HAS_BODY = frozenset({"list_objects_v2", "get_object", "list_multipart_uploads"})
"""Requests whose 404 carries an S3 error document (`NoSuchKey`, `NoSuchBucket`) from a real
store: a bare 404 there comes from something that is not S3."""
_CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
    "ExpiredToken", "403"})
_SEND_SLICE_BYTES = 256 << 10
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


class S3Errors:
    """What botocore's errors mean (`StoreErrors`)."""

    transport_errors = (
        botocore.exceptions.HTTPClientError,  # connection closed or reset, timeouts, proxies
        botocore.exceptions.ConnectionError,  # connection refused, DNS
        botocore.exceptions.ResponseStreamingError,
    )
    endpoint_hint = "AWS_ENDPOINT_URL (or S3Config.endpoint_url)"
    deadline_hint = "raise S3Config.deadline_s (or ASYNCTRON_STORE_DEADLINE_S) to wait longer"

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def answer_of(self, error: Exception) -> Answer | None:
        if isinstance(error, botocore.exceptions.NoCredentialsError
                      | botocore.exceptions.PartialCredentialsError):
            return Answer(Failure.FINAL, None, "NoCredentials", str(error))
        if not isinstance(error, botocore.exceptions.ClientError):
            return None
        info = error.response.get("Error", {})
        code = str(info.get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        message = info.get("Message") or code
        if code in _THROTTLE_CODES or status in (429, 503):
            failure = Failure.THROTTLED
        elif code in _RETRIED_CODES or (status >= 500 and status != 501):
            failure = Failure.TRANSIENT
        else:
            failure = Failure.ANSWERED if status else Failure.FINAL
        return Answer(failure, status or None, code, message)

    def translate(self, where: str, url: ObjectUrl | str, answer: Answer) -> StorageError:
        code, status, message = answer.code, answer.status, answer.message
        operation = where.partition(" ")[0]
        if code == "NoCredentials":
            return StorageError(f"{where}: no credentials found ({message}); {_SET_CREDENTIALS}",
                                path=str(url), errno=None)
        if code == "NoSuchBucket":
            bucket = url.bucket if isinstance(url, ObjectUrl) else url
            return ObjectNotFoundError(
                f"{where}: the bucket {bucket!r} does not exist; create it, or fix the URL's "
                "bucket (and AWS_ENDPOINT_URL if this is the wrong store)", path=str(url),
                errno=None)
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
                f"{where}: the endpoint does not implement this request ({status}: {message}); "
                f"is {self.endpoint} an S3 endpoint? Fix AWS_ENDPOINT_URL (or "
                "S3Config.endpoint_url)",
                path=str(url), errno=None)
        return StorageError(f"{where}: {code}: {message}", path=str(url), errno=None)


class _LoopClient:
    """An aiobotocore client and a client for presigned GETs, of one event loop."""

    def __init__(self, client: Any, config: S3Config) -> None:
        self.client = client
        self.ranges = RangeClient(connect_timeout_s=config.connect_timeout_s,
                                  read_timeout_s=config.read_timeout_s)
        self.presigned = SignedUrls(self._presign, life_s=PRESIGNED_S)

    async def _presign(self, url: ObjectUrl) -> str:
        return str(await self.client.generate_presigned_url(
            "get_object", Params={"Bucket": url.bucket, "Key": url.key},
            ExpiresIn=PRESIGNED_S))

    async def aclose(self) -> None:
        await self.ranges.aclose()
        await self.client.__aexit__(None, None, None)


class S3Client(CloudClient[_LoopClient]):
    """An `ObjectClient` for one S3-compatible store. Concurrency: any number of tasks on any
    loops (requests run on the store I/O loop; a forked child gets a client of its own)."""

    schemes = ("s3",)
    limits = S3_PART_LIMITS
    config: S3Config

    def __init__(self, config: S3Config) -> None:
        endpoint = config.resolved_endpoint() or "AWS S3"
        super().__init__(config, endpoint, S3Errors(endpoint))
        self._session = AioSession(profile=config.profile)
        use_service_model_loader(self._session)

    def _region(self) -> str:
        return (self.config.region or os.environ.get("AWS_REGION")
                or self._session.get_config_variable("region") or "us-east-1")

    async def _connect(self) -> _LoopClient:
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
        return _LoopClient(await creator.__aenter__(), config)

    def _body(self, buffer: memoryview | bytes) -> dict[str, Any]:
        """The `Body` and `ContentLength` parameters that send `buffer`: as it lies, unless
        the config hashes payloads (`sign_payload`, `store_checksums`): then a copy botocore
        can read, hashed on the loop thread (the cost those options carry)."""
        view = memoryview(buffer).cast("B")
        if self.config.sign_payload or self.config.store_checksums:
            return {"Body": io.BytesIO(view), "ContentLength": view.nbytes}
        return {"Body": _BufferPayload(view), "ContentLength": view.nbytes}

    async def _call(self, operation: str, url: ObjectUrl | str, /, **params: Any) -> Any:
        """The client method `operation` with `params`, retried (`StoreRequests.retried`);
        `url` names the object in errors."""
        async def attempt() -> Any:
            client = (await self._loop_client()).client
            return await getattr(client, operation)(**params)

        return await self.requests.retried(operation, url, attempt,
                                           sent_bytes=params.get("ContentLength", 0))

    # -- ObjectReads ----------------------------------------------------------------------

    async def get_small(self, url: ObjectUrl, max_bytes: int) -> tuple[bytes | None, str, int]:
        async def attempt() -> tuple[bytes | None, str, int]:
            client = (await self._loop_client()).client
            response = await client.get_object(Bucket=url.bucket, Key=url.key)
            async with response["Body"] as body:
                size = response.get("ContentLength", 0)
                data = await body.read() if size <= max_bytes else None
            return data, response.get("ETag", ""), size

        return await self.requests.retried("get_object", url, attempt,
                                           received_bytes=lambda found: len(found[0] or b""))

    async def get_into(self, url: ObjectUrl, offset: int, buffers: Sequence[memoryview], *,
                       key: str | None = None, if_match: str | None = None) -> None:
        """One ranged GET of the object's presigned URL (signed once per object, then a plain
        HTTP request whose body the kernel copies straight into the buffers)."""
        nbytes = sum(buffer.nbytes for buffer in buffers)
        if not nbytes:
            return

        async def attempt() -> None:
            found = await self._loop_client()
            await signed_get_into(found.ranges, await found.presigned.get(url), url,
                                  self.endpoint, offset, buffers, key=key, if_match=if_match,
                                  error_of=_client_error)

        try:
            await self.requests.retried("get_object", url, attempt, received_bytes=nbytes)
        except RefusedCredentialsError:  # signed by credentials since rotated: once more
            await on_io_loop(self._forget_presigned(url))
            await self.requests.retried("get_object", url, attempt, received_bytes=nbytes)

    async def _forget_presigned(self, url: ObjectUrl) -> None:
        found = self._clients.get(asyncio.get_running_loop())
        if found is not None:
            found.presigned.forget(url)

    async def head(self, url: ObjectUrl) -> ObjectInfo:
        try:
            head = await self._call("head_object", url, Bucket=url.bucket, Key=url.key)
        except ObjectNotFoundError as error:
            raise ObjectNotFoundError(f"{error}{await self._missing_bucket(url)}",
                                      path=str(url)) from error
        return ObjectInfo(int(head["ContentLength"]), head.get("ETag", ""),
                          dict(head.get("Metadata", {})))

    async def _missing_bucket(self, url: ObjectUrl) -> str:
        """", and the bucket ... does not exist" when that is why (a HEAD's 404 does not say)."""
        try:
            await self._call("head_bucket", url.bucket, Bucket=url.bucket)
        except ObjectNotFoundError:
            return (f", and the bucket {url.bucket!r} does not exist (create it, or fix the "
                    "URL's bucket, and AWS_ENDPOINT_URL if this is the wrong store)")
        except StorageError:
            pass
        return ""

    async def list(self, folder: ObjectUrl, *, recursive: bool = False) -> Listing:
        listing = Listing()
        params = {"Bucket": folder.bucket, "Prefix": folder.prefix}
        if not recursive:
            params["Delimiter"] = "/"
        while True:
            page = await self._call("list_objects_v2", folder, **params)
            for entry in page.get("Contents", ()):
                name = entry["Key"][len(folder.prefix):]
                if not name:
                    continue  # the folder's own marker (`key/`), which some stores keep
                listing.sizes[name] = entry["Size"]
                listing.modified[name] = entry["LastModified"]
            if listing.now is None:
                object.__setattr__(listing, "now", _server_time(page))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return listing
            params["ContinuationToken"] = token

    # -- ObjectWrites ---------------------------------------------------------------------

    async def put(self, url: ObjectUrl, body: bytes | memoryview, *,
                  if_none_match: bool = False, if_match: str | None = None,
                  metadata: dict[str, str] | None = None) -> None:
        conditions: dict[str, Any] = {}
        if if_none_match:
            conditions["IfNoneMatch"] = "*"
        if if_match is not None:
            conditions["IfMatch"] = if_match
        if metadata:
            conditions["Metadata"] = metadata
        await self._call("put_object", url, Bucket=url.bucket, Key=url.key,
                         **self._body(body), **conditions)

    async def delete(self, urls: Sequence[ObjectUrl]) -> None:
        for start in range(0, len(urls), _DELETE_BATCH):
            batch = urls[start:start + _DELETE_BATCH]
            response = await self._call(
                "delete_objects", batch[0], Bucket=batch[0].bucket,
                Delete={"Objects": [{"Key": url.key} for url in batch], "Quiet": True})
            errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if errors:
                where = f"s3://{batch[0].bucket}/{errors[0].get('Key', '')}"
                raise StorageError(f"deleting {where}: {errors[0].get('Code')}: "
                                   f"{errors[0].get('Message')}", path=where, errno=None)

    # -- PartUploads ----------------------------------------------------------------------

    async def start_upload(self, url: ObjectUrl) -> str:
        created = await self._call("create_multipart_upload", url, Bucket=url.bucket,
                                   Key=url.key)
        return created["UploadId"]

    async def upload_part(self, url: ObjectUrl, upload_id: str, number: int,
                          body: bytes | memoryview) -> str:
        sent = await self._call("upload_part", f"{url} part {number}", Bucket=url.bucket,
                                Key=url.key, UploadId=upload_id, PartNumber=number,
                                **self._body(body))
        return sent["ETag"]

    async def complete_upload(self, url: ObjectUrl, upload_id: str,
                              tags: Sequence[str]) -> None:
        parts = [{"ETag": tag, "PartNumber": number} for number, tag in enumerate(tags, 1)]
        await self._call("complete_multipart_upload", url, Bucket=url.bucket, Key=url.key,
                         UploadId=upload_id, MultipartUpload={"Parts": parts})

    async def abort_upload(self, url: ObjectUrl, upload_id: str) -> None:
        with contextlib.suppress(ObjectNotFoundError):  # completed or aborted meanwhile
            await self._call("abort_multipart_upload", url, Bucket=url.bucket, Key=url.key,
                             UploadId=upload_id)

    async def list_uploads(self, folder: ObjectUrl) -> list[OpenUpload]:
        params = {"Bucket": folder.bucket, "Prefix": folder.prefix}
        found: list[OpenUpload] = []
        while True:
            page = await self._call("list_multipart_uploads", folder, **params)
            found += [OpenUpload(upload["Key"], upload["UploadId"], upload.get("Initiated"))
                      for upload in page.get("Uploads", ())]
            if not page.get("IsTruncated"):
                return found
            params.update(KeyMarker=page.get("NextKeyMarker", ""),
                          UploadIdMarker=page.get("NextUploadIdMarker", ""))



def _client_error(status: int, body: bytes) -> botocore.exceptions.ClientError:
    """A failed plain GET as botocore reports one (the S3 error document's code and message),
    so it is retried and translated like any request."""
    code, message = error_document(status, body)
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": message},
         "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def _server_time(response: dict) -> datetime.datetime | None:
    """The store's clock when it sent `response` (its Date header)."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not date:
        return None
    try:
        return email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return None
