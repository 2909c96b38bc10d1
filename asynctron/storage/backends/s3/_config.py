"""`S3Config`: where the store is, who we are, and how hard to push it.

Everything left None comes from the standard AWS chain, as boto3 users expect: the endpoint
from `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` or the profile's `endpoint_url`; credentials
from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (/ `AWS_SESSION_TOKEN`), `AWS_PROFILE` and
the config and credentials files, or an instance role; the region from `AWS_REGION` /
`AWS_DEFAULT_REGION` or the profile.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal

from asynctron._knobs import store_deadline_s, store_job_requests
from asynctron.storage.backends.objects._request_budget import process_share

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class S3Config:
    """How asynctron reaches an S3-compatible store. Validated at construction.

    By default payloads go unsigned (`UNSIGNED-PAYLOAD` in SigV4) and without the store's
    extra checksums: every item's xxh3 digest is in the manifest and verified on load, so
    hashing each byte twice more buys nothing. Over plain http a byte changed in flight is
    then caught by that digest at load, not by the store at upload.
    """

    endpoint_url: str | None = None
    """The store's URL (`http://127.0.0.1:9000`); None: the AWS chain's, else AWS's own."""
    region: str | None = None
    profile: str | None = None
    """A profile of the AWS config files; None: `AWS_PROFILE`, else `default`."""
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    addressing_style: Literal["path", "virtual", "auto"] | None = None
    """None: `path` when an endpoint is set (most compatible stores need it), else `auto`."""
    sign_payload: bool = False
    """SHA-256 every payload into its signature (the loop thread hashes it: ~0.4 s per GiB)."""
    store_checksums: bool = False
    """Have the client send, and the store check, a CRC of every request body."""
    max_requests: int = 64
    """Most requests to the store in flight at once from this process (the request budget;
    throttling shrinks it while the store asks, see `RequestBudget`)."""
    job_max_requests: int | None = field(default_factory=store_job_requests)
    """Most requests in flight at this store from the whole job: each process takes its share
    (`job_max_requests // world size`, at least 1, at most `max_requests`; the world size is
    torch.distributed's, else `WORLD_SIZE`'s, when the client starts). Default:
    `ASYNCTRON_STORE_JOB_REQUESTS`, else None (each process `max_requests`)."""
    single_put_bytes: int = 8 * MiB
    """Files up to this size go as one PUT, larger ones as a multipart upload."""
    deadline_s: float = field(default_factory=store_deadline_s)
    """How long an operation (a save, a load, a dataset read) goes on while the store answers
    none of its requests (resets, timeouts, 5xx and SlowDown retried with backoff meanwhile);
    then it fails, and so do all its requests. Default: `ASYNCTRON_STORE_DEADLINE_S`, else 60."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    abandoned_after_s: float = 3600.0
    """A save on another host whose claim is older than this is taken for dead: the next
    commit under its root deletes its objects and aborts its uploads. A dead save on this host
    is found at once (its process is gone)."""

    def __post_init__(self) -> None:
        for name in ("max_requests", "single_put_bytes", "job_max_requests"):
            value = getattr(self, name)
            if value is None and name == "job_max_requests":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"S3Config.{name}: expected a positive int, found {value!r}")
        for name in ("deadline_s", "connect_timeout_s", "read_timeout_s", "abandoned_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"S3Config.{name}: expected seconds >= 0, found {value!r}")
        if self.deadline_s == 0:
            raise ValueError("S3Config.deadline_s: expected seconds > 0, found 0")
        if self.addressing_style not in (None, "path", "virtual", "auto"):
            raise ValueError("S3Config.addressing_style: expected 'path', 'virtual', 'auto' "
                             f"or None, found {self.addressing_style!r}")

    def process_requests(self, world_size: int) -> int:
        """The most requests this process keeps in flight, one of `world_size` processes."""
        return process_share(self.max_requests, self.job_max_requests, world_size)

    def resolved_endpoint(self) -> str | None:
        """The endpoint requests go to: this config's, else the environment's (None: the one
        botocore derives from the profile, or AWS's for the region)."""
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None)

    def resolved_addressing_style(self) -> str:
        if self.addressing_style is not None:
            return self.addressing_style
        return "path" if self.resolved_endpoint() else "auto"

