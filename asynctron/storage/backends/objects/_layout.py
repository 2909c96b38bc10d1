"""Where things are under a checkpoint root on an object store, and what a name there means.

    s3://bucket/run/                         the root (the checkpoints' common prefix)
        step_100/manifest.json, data files   a checkpoint: committed iff its manifest exists
        latest                               the name of the newest checkpoint
        .asynctron-ledger                    the retention ledger (JSON lines, as locally)
        .asynctron.tmp-<key>-<hex>           a save's claim: present from start to commit

Nothing else is written under a root: a save's data objects sit at their final keys, and a
save that dies leaves its claim, whose body names its checkpoint (and so them) for the next
commit to delete. A claim's name holds nothing of the checkpoint's name, so a scan that picks
checkpoints by name (torchtitan's `step-<digits>`) never takes one for a checkpoint: `<key>`
is a digest of it (shared by every claim to it: `is_claim_to`), `<hex>` random, or a digest of
the area's name for a named area.
"""

from __future__ import annotations

import datetime
import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

LATEST_NAME = "latest"
CLAIM_MARK = ".tmp-"
CLAIM_PREFIX = f".asynctron{CLAIM_MARK}"


@dataclass(frozen=True, slots=True)
class ObjectUrl:
    """`scheme://bucket/key`, split (a bucket is Azure's container)."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @property
    def parent(self) -> ObjectUrl:
        return ObjectUrl(self.scheme, self.bucket, self.key.rpartition("/")[0])

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def prefix(self) -> str:
        """The key prefix of the objects under this one taken as a folder."""
        return f"{self.key}/" if self.key else ""

    def child(self, name: str) -> ObjectUrl:
        """The object `name` under this one taken as a folder."""
        return ObjectUrl(self.scheme, self.bucket, self.prefix + name)


def parse_url(url: str, schemes: tuple[str, ...]) -> ObjectUrl:
    """`scheme://bucket/key/...`, for one of `schemes` (the first names it in errors), as
    bucket and key (no trailing `/`).

    Raises:
        ValueError: none of `schemes`, no bucket, or a key with empty, `.` or `..` parts.
    """
    scheme, found, rest = url.partition("://")
    scheme = scheme.lower()
    if not found or scheme not in schemes:
        raise ValueError(f"path {url!r}: expected a {schemes[0]}://bucket/key URL")
    bucket, _, key = rest.partition("/")
    key = key.rstrip("/")
    parts = key.split("/") if key else []
    if not bucket or any(part in ("", ".", "..") for part in parts) or "\x00" in key:
        raise ValueError(f"path {url!r}: expected {scheme}://bucket/key with a non-empty "
                         "bucket and no empty, '.' or '..' key parts")
    return ObjectUrl(scheme, bucket, key)


def claim_name(checkpoint: str, area: str | None) -> str:
    """The claim of a save to `checkpoint` beside it: `area` names it (every rank of a DCP
    save finds the same one), else it is fresh, unique per call."""
    tail = secrets.token_hex(8) if area is None else _digest(area)
    return f"{CLAIM_PREFIX}{_digest(checkpoint)}-{tail}"


def is_claim_to(name: str, checkpoint: str) -> bool:
    """Whether `name` is that of a claim of a save to `checkpoint` (`claim_name`'s, or
    `.<checkpoint>.tmp-…`, as earlier versions named them)."""
    return name.startswith((f"{CLAIM_PREFIX}{_digest(checkpoint)}-",
                            f".{checkpoint}{CLAIM_MARK}"))


def is_claim_name(name: str) -> bool:
    """Whether `name` is a claim's (`claim_name`'s, or `.<checkpoint>.tmp-…`, as earlier
    versions named them), never a checkpoint's."""
    return name.startswith(".") and CLAIM_MARK in name


def claimed_checkpoint(name: str, owner: Mapping[str, object]) -> str | None:
    """The checkpoint the claim `name`, whose body is `owner`, is for: the one its body names,
    if the claim's name is that of a claim to it; else None (not a claim asynctron wrote)."""
    checkpoint = owner.get("checkpoint")
    if not isinstance(checkpoint, str) or not is_checkpoint_name(checkpoint):
        return None
    return checkpoint if is_claim_to(name, checkpoint) else None


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:16]


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
