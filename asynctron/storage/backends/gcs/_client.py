"""`GcsClient`: the `ObjectClient` of Google Cloud Storage, on its JSON API over aiohttp.

`gs://bucket/key`. Requests go from one aiohttp session per loop (the store I/O loop's);
ranged reads GET `?alt=media` through `RangeClient` with the bearer token, so the body lands
in the caller's buffers. An object's version tag is its generation: the commit point is a
multipart upload with `ifGenerationMatch=0` (create only if absent), a ledger update one with
`ifGenerationMatch=<generation read>`. An object in parts is parts uploaded as objects of
their own beside it (`<key>.asynctron-part-<upload>-<n>`, in flight together), composed into
it 32 at a time, then deleted; an upload that dies leaves its parts, which the sweep finds by
that name. Credentials: Application Default Credentials through google-auth (refreshed off
the loop), none for an emulator (`STORAGE_EMULATOR_HOST`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import json
import os
import secrets
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp

from asynctron._concurrency import to_its_end
from asynctron.errors import ObjectNotFoundError, RefusedCredentialsError, StorageError
from asynctron.storage.backends.gcs._config import GcsConfig
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
from asynctron.storage.backends.objects._signed_gets import signed_get_into

MiB = 1 << 20
GCS_PART_LIMITS = PartLimits(min_part_bytes=5 * MiB, max_parts=32 ** 3)
"""Parts composed 32 at a time, at most three levels deep."""
PART_MARK = ".asynctron-part-"
_COMPOSE_SOURCES = 32
_SEND_SLICE_BYTES = 256 << 10
_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_SET_CREDENTIALS = ("set GOOGLE_APPLICATION_CREDENTIALS (or run `gcloud auth "
                    "application-default login`), or pass GcsConfig(credentials=...)")


class _Answered(Exception):
    """A failed answer of the JSON API: its status and error document."""

    def __init__(self, status: int, body: bytes) -> None:
        try:
            error = json.loads(body)["error"]
            reason = (error.get("errors") or [{}])[0].get("reason") or str(status)
            message = str(error.get("message") or reason)
        except (ValueError, KeyError, TypeError, AttributeError):
            reason, message = str(status), body.decode("utf-8", "replace")[:200]
        super().__init__(f"{reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class GcsErrors:
    """What the JSON API's answers mean (`StoreErrors`)."""

    transport_errors = ()
    endpoint_hint = "STORAGE_EMULATOR_HOST (or GcsConfig.endpoint_url)"
    deadline_hint = "raise GcsConfig.deadline_s (or ASYNCTRON_STORE_DEADLINE_S) to wait longer"

    def answer_of(self, error: Exception) -> Answer | None:
        if not isinstance(error, _Answered):
            return None
        status = error.status
        if status in (429, 503) or error.reason in ("rateLimitExceeded", "slowDown"):
            failure = Failure.THROTTLED
        elif (status >= 500 and status != 501) or status == 408:
            failure = Failure.TRANSIENT
        else:
            failure = Failure.ANSWERED
        return Answer(failure, status, error.reason, error.message)

    def translate(self, where: str, url: ObjectUrl | str, answer: Answer) -> StorageError:
        if answer.status == 404:
            return ObjectNotFoundError(f"{where}: no such object or bucket ({answer})",
                                       path=str(url), errno=None)
        if answer.status == 412:
            return PreconditionFailedError(f"{where}: the condition failed ({answer})",
                                           path=str(url), errno=None)
        if answer.status in (401, 403):
            return RefusedCredentialsError(
                f"{where}: the store refused our credentials ({answer}); {_SET_CREDENTIALS}",
                path=str(url), errno=None)
        return StorageError(f"{where}: {answer}", path=str(url), errno=None)


class _LoopClient:
    """An aiohttp session and a client for ranged GETs, of one event loop."""

    def __init__(self, config: GcsConfig) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.max_requests),
            timeout=aiohttp.ClientTimeout(sock_connect=config.connect_timeout_s,
                                          sock_read=config.read_timeout_s),
            auto_decompress=False)
        self.ranges = RangeClient(connect_timeout_s=config.connect_timeout_s,
                                  read_timeout_s=config.read_timeout_s)

    async def aclose(self) -> None:
        await self.ranges.aclose()
        await self.session.close()


class GcsClient(CloudClient[_LoopClient]):
    """An `ObjectClient` for Google Cloud Storage. Concurrency: any number of tasks on any
    loops (requests run on the store I/O loop)."""

    schemes = ("gs",)
    limits = GCS_PART_LIMITS
    config: GcsConfig

    def __init__(self, config: GcsConfig) -> None:
        super().__init__(config, config.resolved_endpoint(), GcsErrors())
        self._credentials = None if config.is_anonymous() else config.credentials

    async def _connect(self) -> _LoopClient:
        return _LoopClient(self.config)

    async def _headers(self) -> dict[str, str]:
        """The bearer token's header (refreshed off the loop when near expiry)."""
        if self.config.is_anonymous():
            return {}
        if self._credentials is None:
            import google.auth
            from google.auth.exceptions import DefaultCredentialsError

            try:
                self._credentials, _ = await asyncio.to_thread(google.auth.default,
                                                               scopes=[_SCOPE])
            except DefaultCredentialsError as error:
                named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
                if named:
                    what = ": ".join(str(part).rstrip(".") for part in error.args)
                    raise StorageError(
                        f"GCS at {self.endpoint}: the credentials file {named!r} that "
                        f"GOOGLE_APPLICATION_CREDENTIALS names is unusable ({what}); fix or "
                        "replace it (a service account's JSON key), or unset "
                        "GOOGLE_APPLICATION_CREDENTIALS to use gcloud's or the metadata "
                        "server's", path=named, errno=None) from error
                raise StorageError(f"GCS at {self.endpoint}: no credentials found ({error}); "
                                   f"{_SET_CREDENTIALS}, or set STORAGE_EMULATOR_HOST for an "
                                   "emulator", path=self.endpoint, errno=None) from error
        credentials = self._credentials
        if not credentials.valid:
            from google.auth.transport.requests import Request

            await asyncio.to_thread(credentials.refresh, Request())
        return {"Authorization": f"Bearer {credentials.token}"}

    def _object_path(self, url: ObjectUrl) -> str:
        key = urllib.parse.quote(url.key, safe="")
        return f"{self.endpoint}/storage/v1/b/{url.bucket}/o/{key}"

    async def _request(self, method: str, address: str, **options: Any
                       ) -> tuple[Any, str | None]:
        """One try: `method address`; the JSON answer (None without a body) and the store's
        clock (its Date header). Raises `_Answered` for any status but 2xx."""
        session = (await self._loop_client()).session
        headers = {**options.pop("headers", {}), **await self._headers()}
        async with session.request(method, address, headers=headers, **options) as response:
            body = await response.read()
            if response.status >= 300:
                raise _Answered(response.status, body)
            found = json.loads(body) if body.strip() not in (b"", b"null") else None
            return found, response.headers.get("Date")

    async def _call(self, operation: str, url: ObjectUrl | str, method: str, address: str,
                    **options: Any) -> Any:
        """`_request`, retried; its JSON answer."""
        async def attempt() -> Any:
            return (await self._request(method, address, **dict(options)))[0]

        return await self.requests.retried(operation, url, attempt)

    # -- ObjectReads ----------------------------------------------------------------------

    async def head(self, url: ObjectUrl) -> ObjectInfo:
        try:
            found = await self._call("get_metadata", url, "GET", self._object_path(url))
        except ObjectNotFoundError as error:
            if await self._bucket_exists(url):
                raise
            raise self._missing_bucket(url, error) from error
        return ObjectInfo(int(found["size"]), str(found["generation"]),
                          dict(found.get("metadata") or {}))

    async def _bucket_exists(self, url: ObjectUrl) -> bool:
        try:
            await self._call("get_bucket", url.bucket, "GET",
                             f"{self.endpoint}/storage/v1/b/{url.bucket}")
        except ObjectNotFoundError:
            return False
        except StorageError:
            pass
        return True

    def _missing_bucket(self, url: ObjectUrl, error: StorageError) -> ObjectNotFoundError:
        return ObjectNotFoundError(
            f"{error}; the bucket {url.bucket!r} does not exist: create it, or fix the URL's "
            f"bucket (and {GcsErrors.endpoint_hint} if this is the wrong store)",
            path=str(url), errno=None)

    async def get_small(self, url: ObjectUrl, max_bytes: int) -> tuple[bytes | None, str, int]:
        """The metadata first (size, generation), then the bytes of that generation."""
        info = await self.head(url)
        if info.size > max_bytes:
            return None, info.etag, info.size
        data = bytearray(info.size)
        if info.size:
            await self.get_into(url, 0, [memoryview(data)], if_match=info.etag)
        return bytes(data), info.etag, info.size

    async def get_into(self, url: ObjectUrl, offset: int, buffers: Sequence[memoryview], *,
                       key: str | None = None, if_match: str | None = None) -> None:
        nbytes = sum(buffer.nbytes for buffer in buffers)
        if not nbytes:
            return
        address = f"{self._object_path(url)}?alt=media"
        if if_match is not None:
            address += f"&ifGenerationMatch={if_match}"

        async def attempt() -> None:
            await signed_get_into((await self._loop_client()).ranges, address, url,
                                  self.endpoint, offset, buffers, key=key, if_match=None,
                                  error_of=_Answered, headers=await self._headers())

        await self.requests.retried("get_media", url, attempt, received_bytes=nbytes)

    async def list(self, folder: ObjectUrl, *, recursive: bool = False) -> Listing:
        listing = Listing()
        params = {"prefix": folder.prefix, "maxResults": "1000"}
        if not recursive:
            params["delimiter"] = "/"
        address = f"{self.endpoint}/storage/v1/b/{folder.bucket}/o"
        while True:
            try:
                page, date = await self.requests.retried(
                    "list_objects", folder,
                    lambda sent=dict(params): self._request("GET", address, params=sent))
            except ObjectNotFoundError as error:  # a listing's 404: the bucket's
                raise self._missing_bucket(folder, error) from error
            for item in (page or {}).get("items", ()):
                name = item["name"][len(folder.prefix):]
                if name:
                    listing.sizes[name] = int(item["size"])
                    listing.modified[name] = datetime.datetime.fromisoformat(item["updated"])
            if listing.now is None and date:
                object.__setattr__(listing, "now", email.utils.parsedate_to_datetime(date))
            token = (page or {}).get("nextPageToken")
            if not token:
                return listing
            params["pageToken"] = token

    # -- ObjectWrites ---------------------------------------------------------------------

    async def put(self, url: ObjectUrl, body: bytes | memoryview, *,
                  if_none_match: bool = False, if_match: str | None = None,
                  metadata: dict[str, str] | None = None) -> None:
        condition = if_match if if_match is not None else "0" if if_none_match else None
        await self._upload(url, body, condition, metadata, "upload_object", url)

    async def _upload(self, url: ObjectUrl, body: bytes | memoryview, generation: str | None,
                      metadata: dict[str, str] | None, operation: str,
                      named: ObjectUrl | str) -> None:
        """One multipart upload (metadata and bytes), sent from where the bytes lie; only
        over `generation` if given ("0": only if absent). `operation` and `named` name it in
        errors.

        Cancellation: waits for the answer (or the failure) first, as every request here that
        makes an object does: a part is an object of its own, and a request cut off once its
        body was sent may still be stored after the save's abort has listed what to delete.
        """
        view = memoryview(body).cast("B")
        params = {"uploadType": "multipart"}
        if generation is not None:
            params["ifGenerationMatch"] = generation
        boundary = secrets.token_hex(16)
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps({'name': url.key, 'metadata': metadata or {}})}\r\n"
                f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        address = f"{self.endpoint}/upload/storage/v1/b/{url.bucket}/o"

        async def attempt() -> None:
            await self._request(
                "POST", address, params=params, data=_body(head, view, tail),
                headers={"Content-Type": f"multipart/related; boundary={boundary}",
                         "Content-Length": str(len(head) + view.nbytes + len(tail))})

        await to_its_end(self.requests.retried(operation, named, attempt,
                                               sent_bytes=view.nbytes))

    async def delete(self, urls: Sequence[ObjectUrl]) -> None:
        async def delete_one(url: ObjectUrl) -> None:
            with contextlib.suppress(ObjectNotFoundError):  # gone already
                await self._call("delete_object", url, "DELETE", self._object_path(url))

        async with asyncio.TaskGroup() as group:
            for url in urls:
                group.create_task(delete_one(url))

    # -- PartUploads ----------------------------------------------------------------------

    async def start_upload(self, url: ObjectUrl) -> str:
        return secrets.token_hex(8)

    def _part(self, url: ObjectUrl, upload_id: str, name: str) -> ObjectUrl:
        return ObjectUrl(url.scheme, url.bucket, f"{url.key}{PART_MARK}{upload_id}-{name}")

    async def upload_part(self, url: ObjectUrl, upload_id: str, number: int,
                          body: bytes | memoryview) -> str:
        part = self._part(url, upload_id, f"{number:05d}")
        await self._upload(part, body, None, None, "upload_part", f"{url} part {number}")
        return part.key

    async def complete_upload(self, url: ObjectUrl, upload_id: str,
                              tags: Sequence[str]) -> None:
        """Compose the parts into `url`, 32 at a time (a level of composed pieces between,
        past 32 parts), then delete the parts and the pieces."""
        sources, level, made = list(tags), 0, []
        while len(sources) > _COMPOSE_SOURCES:
            level += 1
            pieces = []
            for start in range(0, len(sources), _COMPOSE_SOURCES):
                piece = self._part(url, upload_id, f"c{level}-{start // _COMPOSE_SOURCES:05d}")
                await self._compose(piece, sources[start:start + _COMPOSE_SOURCES])
                pieces.append(piece.key)
            made += pieces
            sources = pieces
        await self._compose(url, sources)
        await self.delete([ObjectUrl(url.scheme, url.bucket, key) for key in [*tags, *made]])

    async def _compose(self, url: ObjectUrl, sources: Sequence[str]) -> None:
        body = {"sourceObjects": [{"name": name} for name in sources],
                "destination": {"contentType": "application/octet-stream"}}
        await to_its_end(self._call("compose", url, "POST", f"{self._object_path(url)}/compose",
                                    json=body))

    async def abort_upload(self, url: ObjectUrl, upload_id: str) -> None:
        """Delete the upload's parts (all parts of uploads to `url` when `upload_id` is "")."""
        prefix = f"{url.key}{PART_MARK}{upload_id}"
        parent = url.parent
        found = await self.list(parent, recursive=True)
        await self.delete([parent.child(name) for name in found.sizes
                           if parent.child(name).key.startswith(prefix)])

    async def list_uploads(self, folder: ObjectUrl) -> list[OpenUpload]:
        """One per upload whose parts are under `folder`, started when its first part was."""
        found = await self.list(folder, recursive=True)
        uploads: dict[tuple[str, str], OpenUpload] = {}
        for name, modified in found.modified.items():
            key, mark, rest = folder.child(name).key.rpartition(PART_MARK)
            if mark and (key, rest.partition("-")[0]) not in uploads:
                uploads[key, rest.partition("-")[0]] = OpenUpload(key, rest.partition("-")[0],
                                                                  modified)
        return list(uploads.values())



async def _body(head: bytes, view: memoryview, tail: bytes) -> AsyncIterator[bytes | memoryview]:
    """A multipart body sent from where its bytes lie, a slice at a time."""
    yield head
    for start in range(0, view.nbytes, _SEND_SLICE_BYTES):
        yield view[start:start + _SEND_SLICE_BYTES]
    yield tail
