"""`ObjectClient`: what the object-store layer asks of one cloud's store, and nothing more.

The commit protocol, the writers, the readers and the dataset files (`ObjectStoreBackend`
and its parts) are written once against this Protocol; a cloud brings one client module
(S3, Azure Blob) that implements it and registers its URL schemes. Every request of a
client runs on the store I/O loop (`io_loop`), holds a place in its request budget and is
retried inside the caller's store operation (`StoreRequests`); its failures are errors that
name the endpoint, the object and what to set: `ObjectNotFoundError` (a FileNotFoundError)
for a missing object or bucket, `PreconditionFailedError` for a failed condition,
`asynctron.errors.RefusedCredentialsError` for refused credentials, else a `StorageError`.

The client's parts are split by who calls them: `ObjectReads` (reads, listings), `ObjectWrites`
(whole-object writes, deletes) and `PartUploads` (an object written in parts).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from asynctron.errors import StorageError
from asynctron.storage.backends.objects._layout import Listing, ObjectUrl
from asynctron.storage.backends.objects._store_config import StoreConfig


class PreconditionFailedError(StorageError):
    """A conditional write found the object not as required (it exists, or changed)."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a HEAD says of an object: its size, its version tag (an ETag) and the user
    metadata it was written with."""

    size: int
    etag: str
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OpenUpload:
    """An upload in parts that was started and neither completed nor aborted."""

    key: str
    upload_id: str
    started: datetime.datetime | None
    """By the store's clock (None: unknown, taken as long ago)."""


@dataclass(frozen=True, slots=True)
class PartLimits:
    """A store's bounds on an upload in parts."""

    min_part_bytes: int
    """Every part but the last is at least this big."""
    max_parts: int

    def least_part_bytes(self, nbytes: int) -> int:
        """The least size of a part (but the last) of a `nbytes` upload, grown to stay
        within `max_parts`. A staging slab at least this big is a part by itself."""
        return max(self.min_part_bytes, -(-nbytes // self.max_parts))


class ObjectReads(Protocol):
    """Reads: what loading a checkpoint and reading a dataset ask."""

    async def get_small(self, url: ObjectUrl, max_bytes: int) -> tuple[bytes | None, str, int]:
        """The whole object if it holds at most `max_bytes` (else None, unread), its version
        tag and its size."""

    async def get_into(self, url: ObjectUrl, offset: int, buffers: Sequence[memoryview], *,
                       key: str | None = None, if_match: str | None = None) -> None:
        """Fill `buffers`, one after another, with the object's bytes from `offset` (one
        ranged GET, retried whole); with `if_match`, only from that version.

        Raises:
            CorruptCheckpointError: the object ends before the buffers are full (naming
                `key`, the item being read; without one, a StorageError).
            PreconditionFailedError: the object is no longer the version `if_match`.
        """

    async def head(self, url: ObjectUrl) -> ObjectInfo:
        """The object's size, version tag and metadata (a missing bucket is named)."""

    async def list(self, folder: ObjectUrl, *, recursive: bool = False) -> Listing:
        """The objects under `folder`: directly under it, or (`recursive`) at any depth,
        named relative to it; every page, with the store's clock of the first."""


class ObjectWrites(Protocol):
    """Whole objects: the commit protocol's claims, manifests, ledger and deletes."""

    async def put(self, url: ObjectUrl, body: bytes | memoryview, *,
                  if_none_match: bool = False, if_match: str | None = None,
                  metadata: dict[str, str] | None = None) -> None:
        """Store `body` as the object (atomically: readers see the old one or all of it).
        `if_none_match`: only if no object is there; `if_match`: only over that version.

        Raises:
            PreconditionFailedError: the condition failed (nothing written).
        """

    async def delete(self, urls: Sequence[ObjectUrl]) -> None:
        """Delete the objects (all in one bucket); a missing one is no error."""


class PartUploads(Protocol):
    """An object written in parts: nothing is visible until `complete_upload`."""

    limits: PartLimits

    async def start_upload(self, url: ObjectUrl) -> str:
        """A new upload to `url`; returns its id."""

    async def upload_part(self, url: ObjectUrl, upload_id: str, number: int,
                          body: bytes | memoryview) -> str:
        """Store part `number` (from 1) of the upload; returns its tag for `complete_upload`."""

    async def complete_upload(self, url: ObjectUrl, upload_id: str,
                              tags: Sequence[str]) -> None:
        """Make the object of the parts whose `tags` are given, in order (part 1 first)."""

    async def abort_upload(self, url: ObjectUrl, upload_id: str) -> None:
        """Drop the upload's parts (one already gone is no error)."""

    async def list_uploads(self, folder: ObjectUrl) -> list[OpenUpload]:
        """The open uploads to keys under `folder` (at any depth)."""


@runtime_checkable
class ObjectClient(ObjectReads, ObjectWrites, PartUploads, Protocol):
    """One store's requests, from any number of threads and loops (each runs on the store I/O
    loop). `schemes`: the URL schemes it serves, the first its name."""

    schemes: tuple[str, ...]
    endpoint: str
    config: StoreConfig

    @property
    def most_in_flight(self) -> int:
        """The most requests this client had in flight at once (0 before any)."""

    async def aclose(self) -> None:
        """On the I/O loop: close its connections."""
