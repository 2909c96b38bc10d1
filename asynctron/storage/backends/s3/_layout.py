"""Where things are under a checkpoint root on a store, and what a name there means.

    s3://bucket/run/                         the root (the checkpoints' common prefix)
        step_100/manifest.json, data files   a checkpoint: committed iff its manifest exists
        latest                               the name of the newest checkpoint
        .asynctron-ledger                    the retention ledger (JSON lines, as locally)
        .step_200.tmp-<host>-<pid>-<token>   a save's claim: present from start to commit

Nothing else is written under a root: a save's data objects sit at their final keys, and a
save that dies leaves its claim, which names them for the next commit to delete.
"""

from __future__ import annotations

import datetime
import email.utils
import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asynctron.storage.backends.s3._client import S3Client

LATEST_NAME = "latest"
CLAIM_MARK = ".tmp-"


@dataclass(frozen=True, slots=True)
class ObjectUrl:
    """`s3://bucket/key`, split."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def parent(self) -> ObjectUrl:
        return ObjectUrl(self.bucket, self.key.rpartition("/")[0])

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def prefix(self) -> str:
        """The key prefix of the objects under this one taken as a folder."""
        return f"{self.key}/" if self.key else ""

    def child(self, name: str) -> ObjectUrl:
        """The object `name` under this one taken as a folder."""
        return ObjectUrl(self.bucket, self.prefix + name)


def parse_url(url: str) -> ObjectUrl:
    """`s3://bucket/key/...` as bucket and key (no trailing `/`).

    Raises:
        ValueError: not an s3 URL, no bucket, or a key with empty, `.` or `..` parts.
    """
    if not url.lower().startswith("s3://"):
        raise ValueError(f"path {url!r}: expected an s3://bucket/key URL")
    bucket, _, key = url[5:].partition("/")
    key = key.rstrip("/")
    parts = key.split("/") if key else []
    if not bucket or any(part in ("", ".", "..") for part in parts) or "\x00" in key:
        raise ValueError(f"path {url!r}: expected s3://bucket/key with a non-empty bucket and "
                         "no empty, '.' or '..' key parts")
    return ObjectUrl(bucket, key)


def claim_name(checkpoint: str, area: str | None) -> str:
    """The claim of a save to `checkpoint` beside it: `area` names it (every rank of a DCP
    save finds the same one), else it is fresh, unique per host, process and call."""
    if area is None:
        host = socket.gethostname().replace("-", "_")
        area = f"{host}-{os.getpid()}-{secrets.token_hex(4)}"
    return f".{checkpoint}{CLAIM_MARK}{area}"


def claimed_checkpoint(name: str) -> str | None:
    """The checkpoint a claim named `name` is for, or None if `name` is no claim."""
    if not name.startswith(".") or CLAIM_MARK not in name:
        return None
    return name[1:].rpartition(CLAIM_MARK)[0] or None


def is_checkpoint_name(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".") and name not in (
        LATEST_NAME,)


@dataclass(frozen=True, slots=True)
class Listing:
    """The objects directly under a folder (name -> size, name -> last modified), and the
    store's clock when it answered (ages are measured on it, never on ours)."""

    sizes: dict[str, int] = field(default_factory=dict)
    modified: dict[str, datetime.datetime] = field(default_factory=dict)
    now: datetime.datetime | None = None

    def age_s(self, name: str) -> float:
        """Seconds since `name` was written, by the store's clock (0 if unknown)."""
        if self.now is None or name not in self.modified:
            return 0.0
        return (self.now - self.modified[name]).total_seconds()


async def list_folder(client: S3Client, folder: ObjectUrl) -> Listing:
    """The objects directly under `folder` (not in its sub-folders)."""
    listing = Listing()
    params = {"Bucket": folder.bucket, "Prefix": folder.prefix, "Delimiter": "/"}
    while True:
        page = await client.call("list_objects_v2", folder, **params)
        for entry in page.get("Contents", ()):
            name = entry["Key"][len(folder.prefix):]
            listing.sizes[name] = entry["Size"]
            listing.modified[name] = entry["LastModified"]
        if listing.now is None:
            object.__setattr__(listing, "now", server_time(page))
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return listing
        params["ContinuationToken"] = token


async def list_objects(client: S3Client, folder: ObjectUrl) -> dict[str, int]:
    """The objects directly under `folder`: name -> size."""
    return (await list_folder(client, folder)).sizes


def server_time(response: dict) -> datetime.datetime | None:
    """The store's clock when it sent `response` (its Date header)."""
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not date:
        return None
    try:
        return email.utils.parsedate_to_datetime(date)
    except (TypeError, ValueError):
        return None
