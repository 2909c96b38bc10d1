"""`AzureClient`: the `ObjectClient` of Azure Blob Storage, on azure-storage-blob's aio client.

`az://container/key` (also `abfs://`): a bucket is a container. One `BlobServiceClient` per
loop (the store I/O loop's), its SDK retries off: `StoreRequests` retries inside the
operation's deadline, and `AzureErrors` says what the service's answers mean. Ranged reads
GET the blob's SAS URL (signed with the account key, or a user delegation key) through
`RangeClient`, so the body lands in the caller's buffers. The commit point is the service's
own conditional write (`If-None-Match: *`); an object in parts is staged blocks committed by
one Put Block List. Azure has no upload ids and no call that drops staged blocks: an upload's
id names its blocks; aborting one deletes a blob that has staged blocks only and never
touches a committed one (whose next commit drops the blocks, or the service after a week).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import secrets
from collections.abc import AsyncIterator, Sequence
from typing import Any

from azure.core import MatchConditions
from azure.core.exceptions import (
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import BlobSasPermissions, generate_blob_sas
from azure.storage.blob.aio import BlobServiceClient

from asynctron.errors import ObjectNotFoundError, RefusedCredentialsError, StorageError
from asynctron.storage.backends.azure._config import AzureConfig
from asynctron.storage.backends.objects._client import (
    ObjectInfo,
    OpenUpload,
    PartLimits,
    PreconditionFailedError,
)
from asynctron.storage.backends.objects._cloud_client import CloudClient
from asynctron.storage.backends.objects._http_ranges import RangeClient
from asynctron.storage.backends.objects._layout import Listing, ObjectUrl
from asynctron.storage.backends.objects._requests import Answer, Failure
from asynctron.storage.backends.objects._signed_gets import (
    SignedUrls,
    error_document,
    signed_get_into,
)

MiB = 1 << 20
AZURE_PART_LIMITS = PartLimits(min_part_bytes=4 * MiB, max_parts=50_000)
"""A block blob has at most 50,000 blocks; blocks below a few MiB only cost requests."""
SAS_S = 3600
"""How long a SAS URL is valid (one is made again at half of it)."""
_FIRST_GET_BYTES = 4 * MiB
"""What the first GET of a whole object asks for (`get_small` stops there if it is larger)."""
_SEND_SLICE_BYTES = 256 << 10
_ONE_REQUEST_BYTES = 1 << 20
"""The largest body sent as bytes in one Put Blob (the SDK sends nothing else there: beyond,
aiohttp's transport would copy what the socket did not take, on the loop thread)."""
_CONDITION_CODES = frozenset({"ConditionNotMet", "BlobAlreadyExists", "TargetConditionNotMet"})
_MISSING_CODES = frozenset({"BlobNotFound", "ContainerNotFound"})
_CREDENTIAL_CODES = frozenset({
    "AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
    "InvalidAuthenticationInfo", "NoAuthenticationInformation"})
_THROTTLE_CODES = frozenset({"ServerBusy", "OperationTimedOut", "TooManyRequests"})
_SET_CREDENTIALS = ("set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME and "
                    "AZURE_STORAGE_ACCOUNT_KEY, or pass AzureConfig(...)")


class _Answered(Exception):
    """A plain GET's failed answer, as the SDK would report it."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status_code, self.error_code, self.message = status, code, message


class AzureErrors:
    """What azure-core's errors mean (`StoreErrors`)."""

    transport_errors = (ServiceRequestError, ServiceResponseError)
    endpoint_hint = "AZURE_STORAGE_CONNECTION_STRING (or AzureConfig.account_url)"
    deadline_hint = ("raise AzureConfig.deadline_s (or ASYNCTRON_STORE_DEADLINE_S) to wait "
                     "longer")

    def __init__(self, account_url: str) -> None:
        self.account_url = account_url

    def answer_of(self, error: Exception) -> Answer | None:
        if not isinstance(error, HttpResponseError | _Answered) or not error.status_code:
            return None
        status = int(error.status_code)
        found = getattr(error, "error_code", None)
        code = str(getattr(found, "value", found) or status)  # a str, or the SDK's str enum
        if code in _THROTTLE_CODES or status in (429, 503):
            failure = Failure.THROTTLED
        elif status >= 500 and status != 501:
            failure = Failure.TRANSIENT
        else:
            failure = Failure.ANSWERED
        message = str(getattr(error, "reason", None) or error.message or code).splitlines()[0]
        return Answer(failure, status, code, message)

    def translate(self, where: str, url: ObjectUrl | str, answer: Answer) -> StorageError:
        code, status = answer.code, answer.status
        if code == "ContainerNotFound":
            container = url.bucket if isinstance(url, ObjectUrl) else url
            return ObjectNotFoundError(
                f"{where}: the container {container!r} does not exist; create it, or fix the "
                "URL's container (and the account, if this is the wrong one)", path=str(url),
                errno=None)
        if code == "ResourceNotFound":  # not a blob's answer (BlobNotFound): the account's
            container = url.bucket if isinstance(url, ObjectUrl) else url
            return ObjectNotFoundError(
                f"{where}: the account {self.account_url} (or its container {container!r}) was "
                f"not found ({code}); fix the account in {self.endpoint_hint}, or the URL's "
                "container", path=str(url), errno=None)
        if code in _MISSING_CODES or status == 404:
            return ObjectNotFoundError(f"{where}: no such object ({code})", path=str(url),
                                       errno=None)
        if code in _CONDITION_CODES or status == 412:
            return PreconditionFailedError(f"{where}: the condition failed ({answer})",
                                           path=str(url), errno=None)
        if code in _CREDENTIAL_CODES or status in (401, 403):
            return RefusedCredentialsError(
                f"{where}: the service refused our credentials ({answer}); {_SET_CREDENTIALS}",
                path=str(url), errno=None)
        return StorageError(f"{where}: {answer}", path=str(url), errno=None)


class _LoopClient:
    """A `BlobServiceClient` and a client for SAS GETs, of one event loop."""

    def __init__(self, service: BlobServiceClient, config: AzureConfig, account: str,
                 key: str | None) -> None:
        self.service = service
        self.ranges = RangeClient(connect_timeout_s=config.connect_timeout_s,
                                  read_timeout_s=config.read_timeout_s)
        self.signed = SignedUrls(self._sign, life_s=SAS_S)
        self._account = account
        self._key = key
        self._delegation: Any = None

    async def _sign(self, url: ObjectUrl) -> str:
        """`url`'s read-only SAS URL (the account key's, else a user delegation key's)."""
        expiry = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=SAS_S)
        if self._key is None and (self._delegation is None
                                  or self._delegation.signed_expiry < _iso(expiry)):
            self._delegation = await self.service.get_user_delegation_key(
                datetime.datetime.now(datetime.UTC), expiry + datetime.timedelta(hours=1))
        sas = generate_blob_sas(self._account, url.bucket, url.key, account_key=self._key,
                                user_delegation_key=self._delegation,
                                permission=BlobSasPermissions(read=True), expiry=expiry)
        return f"{self.service.get_blob_client(url.bucket, url.key).url}?{sas}"

    async def aclose(self) -> None:
        await self.ranges.aclose()
        await self.service.close()


class AzureClient(CloudClient[_LoopClient]):
    """An `ObjectClient` for one Azure storage account. Concurrency: any number of tasks on
    any loops (requests run on the store I/O loop)."""

    schemes = ("az", "abfs")
    limits = AZURE_PART_LIMITS
    config: AzureConfig

    def __init__(self, config: AzureConfig) -> None:
        endpoint, self._account, self._key, self._credential = config.resolved()
        super().__init__(config, endpoint, AzureErrors(endpoint))

    async def _connect(self) -> _LoopClient:
        service = BlobServiceClient(
            self.endpoint, credential=self._credential, retry_total=0,
            connection_timeout=self.config.connect_timeout_s,
            read_timeout=self.config.read_timeout_s,
            max_single_put_size=max(self.config.single_put_bytes, 64 * MiB),
            max_single_get_size=_FIRST_GET_BYTES)
        return _LoopClient(service, self.config, self._account, self._key)

    async def _blob(self, url: ObjectUrl) -> Any:
        return (await self._loop_client()).service.get_blob_client(url.bucket, url.key)

    async def _call(self, operation: str, url: ObjectUrl | str, request: Any, *,
                    sent_bytes: int = 0) -> Any:
        """`request()` (an SDK call), retried (`StoreRequests.retried`)."""
        return await self.requests.retried(operation, url, request, sent_bytes=sent_bytes)

    # -- ObjectReads ----------------------------------------------------------------------

    async def get_small(self, url: ObjectUrl, max_bytes: int) -> tuple[bytes | None, str, int]:
        async def attempt() -> tuple[bytes | None, str, int]:
            download = await (await self._blob(url)).download_blob(max_concurrency=1)
            size = download.properties.size
            data = await download.readall() if size <= max_bytes else None
            return data, download.properties.etag, size

        return await self.requests.retried("get_blob", url, attempt,
                                           received_bytes=lambda found: len(found[0] or b""))

    async def get_into(self, url: ObjectUrl, offset: int, buffers: Sequence[memoryview], *,
                       key: str | None = None, if_match: str | None = None) -> None:
        nbytes = sum(buffer.nbytes for buffer in buffers)
        if not nbytes:
            return

        async def attempt() -> None:
            found = await self._loop_client()
            await signed_get_into(found.ranges, await found.signed.get(url), url,
                                  self.endpoint, offset, buffers, key=key, if_match=if_match,
                                  error_of=_answered)

        await self.requests.retried("get_blob", url, attempt, received_bytes=nbytes)

    async def head(self, url: ObjectUrl) -> ObjectInfo:
        async def attempt() -> Any:
            return await (await self._blob(url)).get_blob_properties()

        found = await self._call("head_blob", url, attempt)
        metadata = {name.replace("_", "-"): value
                    for name, value in (found.metadata or {}).items()}
        return ObjectInfo(found.size, found.etag, metadata)

    async def list(self, folder: ObjectUrl, *, recursive: bool = False) -> Listing:
        listing = Listing()
        clock: list[datetime.datetime] = []

        def note_time(response: Any) -> None:
            date = response.http_response.headers.get("Date")
            if date and not clock:
                clock.append(_parse_http_date(date))

        async def attempt() -> None:
            listing.sizes.clear()
            container = (await self._loop_client()).service.get_container_client(folder.bucket)
            blobs = (container.list_blobs(name_starts_with=folder.prefix,
                                          raw_response_hook=note_time) if recursive
                     else container.walk_blobs(name_starts_with=folder.prefix, delimiter="/",
                                               raw_response_hook=note_time))
            async for blob in blobs:
                if getattr(blob, "size", None) is None:
                    continue  # a sub-folder (BlobPrefix)
                name = blob.name[len(folder.prefix):]
                listing.sizes[name] = blob.size
                listing.modified[name] = blob.last_modified

        await self._call("list_blobs", folder, attempt)
        object.__setattr__(listing, "now", clock[0] if clock else None)
        return listing

    # -- ObjectWrites ---------------------------------------------------------------------

    async def put(self, url: ObjectUrl, body: bytes | memoryview, *,
                  if_none_match: bool = False, if_match: str | None = None,
                  metadata: dict[str, str] | None = None) -> None:
        """Up to `_ONE_REQUEST_BYTES`, one Put Blob (its body copied once); beyond, the body
        staged as one block from where it lies, then committed with the conditions."""
        view = memoryview(body).cast("B")
        conditions: dict[str, Any] = {"metadata": _metadata(metadata)}
        if if_match is not None:
            conditions.update(etag=if_match, match_condition=MatchConditions.IfNotModified)
        elif if_none_match:
            conditions.update(match_condition=MatchConditions.IfMissing)
        if view.nbytes > _ONE_REQUEST_BYTES:
            block = await self.upload_part(url, await self.start_upload(url), 1, view)

            async def commit() -> None:
                await (await self._blob(url)).commit_block_list([block], **conditions)

            await self._call("put_block_list", url, commit)
            return
        data = bytes(view)

        async def attempt() -> None:
            await (await self._blob(url)).upload_blob(data, length=len(data), overwrite=True,
                                                      **conditions)

        await self._call("put_blob", url, attempt, sent_bytes=len(data))

    async def delete(self, urls: Sequence[ObjectUrl]) -> None:
        async def delete_one(url: ObjectUrl) -> None:
            async def attempt() -> None:
                with contextlib.suppress(ResourceNotFoundError):
                    await (await self._blob(url)).delete_blob()

            await self._call("delete_blob", url, attempt)

        async with asyncio.TaskGroup() as group:
            for url in urls:
                group.create_task(delete_one(url))

    # -- PartUploads ----------------------------------------------------------------------

    async def start_upload(self, url: ObjectUrl) -> str:
        return secrets.token_hex(8)

    async def upload_part(self, url: ObjectUrl, upload_id: str, number: int,
                          body: bytes | memoryview) -> str:
        block = f"{upload_id}-{number:06d}"  # the SDK base64-encodes it; all of a blob's alike
        view = memoryview(body).cast("B")

        async def attempt() -> None:
            await (await self._blob(url)).stage_block(block, _slices(view), length=view.nbytes)

        await self._call("put_block", f"{url} block {number}", attempt, sent_bytes=view.nbytes)
        return block

    async def complete_upload(self, url: ObjectUrl, upload_id: str,
                              tags: Sequence[str]) -> None:
        async def attempt() -> None:
            await (await self._blob(url)).commit_block_list(list(tags))

        await self._call("put_block_list", url, attempt)

    async def abort_upload(self, url: ObjectUrl, upload_id: str) -> None:
        """Deletes a blob that has staged blocks only (Azurite allows it); where the service
        refuses (404: no committed blob), commits an empty blob only where none exists
        (`If-None-Match: *`) and deletes it, so the blocks go with it. Over an existing blob,
        nothing is done: its next commit drops the blocks."""
        async def attempt() -> None:
            blob = await self._blob(url)
            if await self._exists(blob):
                return  # a committed blob is there: never touched
            try:
                await blob.delete_blob()
                return
            except ResourceNotFoundError:
                pass
            try:
                made = await blob.commit_block_list([],
                                                    match_condition=MatchConditions.IfMissing)
            except HttpResponseError as error:
                if error.status_code in (409, 412):
                    return
                raise
            with contextlib.suppress(ResourceNotFoundError):
                await blob.delete_blob(etag=made["etag"],
                                       match_condition=MatchConditions.IfNotModified)

        await self._call("abort_blocks", url, attempt)

    async def _exists(self, blob: Any) -> bool:
        try:
            await blob.get_blob_properties()
        except ResourceNotFoundError:
            return False
        return True

    async def list_uploads(self, folder: ObjectUrl) -> list[OpenUpload]:
        found: list[OpenUpload] = []

        async def attempt() -> None:
            found.clear()
            container = (await self._loop_client()).service.get_container_client(folder.bucket)
            committed = {blob.name async for blob in container.list_blobs(
                name_starts_with=folder.prefix)}
            async for blob in container.list_blobs(name_starts_with=folder.prefix,
                                                   include=["uncommittedblobs"]):
                if blob.name not in committed:  # staged blocks only: never committed
                    found.append(OpenUpload(blob.name, "", blob.creation_time))

        await self._call("list_blobs", folder, attempt)
        return found


async def _slices(view: memoryview) -> AsyncIterator[memoryview]:
    """A request body sent from the buffer where it lies, a slice at a time (as bytes, the
    transport would copy what the socket did not take, on the loop thread)."""
    for start in range(0, view.nbytes, _SEND_SLICE_BYTES):
        yield view[start:start + _SEND_SLICE_BYTES]


def _metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """Metadata names are C# identifiers on Azure: `-` becomes `_` (and back in `head`; the
    names asynctron writes have no `_`)."""
    if not metadata:
        return None
    return {name.replace("-", "_"): value for name, value in metadata.items()}


def _answered(status: int, body: bytes) -> _Answered:
    code, message = error_document(status, body)
    return _Answered(status, code, message.splitlines()[0] if message else "")


def _iso(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_http_date(text: str) -> datetime.datetime:
    return email.utils.parsedate_to_datetime(text)
