"""`GcsConfig`: where Google Cloud Storage is, who we are, and how hard to push it.

Left None, everything comes from Google's standard settings: the endpoint from
`STORAGE_EMULATOR_HOST` (an emulator: no credentials), else `https://storage.googleapis.com`
with Application Default Credentials (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud's, the
metadata server's) through google-auth.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from asynctron._knobs import store_deadline_s, store_job_requests
from asynctron.storage.backends.objects._request_budget import process_share

MiB = 1 << 20
GOOGLE_ENDPOINT = "https://storage.googleapis.com"


@dataclass(frozen=True, slots=True)
class GcsConfig:
    """How asynctron reaches Google Cloud Storage (JSON API). Validated at construction."""

    endpoint_url: str | None = None
    """None: `STORAGE_EMULATOR_HOST`, else Google's."""
    credentials: Any = None
    """google-auth credentials; None: Application Default Credentials (none for an emulator)."""
    anonymous: bool | None = None
    """Send no credentials; None: to an endpoint other than Google's (an emulator), unless
    `credentials` are given."""
    max_requests: int = 64
    """Most requests in flight at once from this process (the request budget)."""
    job_max_requests: int | None = field(default_factory=store_job_requests)
    """Most requests in flight from the whole job; each process takes its share. Default:
    `ASYNCTRON_STORE_JOB_REQUESTS`, else None."""
    single_put_bytes: int = 8 * MiB
    """Files up to this size go as one upload, larger ones as parts composed into one."""
    deadline_s: float = field(default_factory=store_deadline_s)
    """How long an operation goes on while the store answers none of its requests. Default:
    `ASYNCTRON_STORE_DEADLINE_S`, else 60."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    abandoned_after_s: float = 3600.0
    """A save on another host whose claim is older than this is taken for dead."""

    def __post_init__(self) -> None:
        for name in ("max_requests", "single_put_bytes", "job_max_requests"):
            value = getattr(self, name)
            if value is None and name == "job_max_requests":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GcsConfig.{name}: expected a positive int, found {value!r}")
        for name in ("deadline_s", "connect_timeout_s", "read_timeout_s", "abandoned_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"GcsConfig.{name}: expected seconds >= 0, found {value!r}")
        if self.deadline_s == 0:
            raise ValueError("GcsConfig.deadline_s: expected seconds > 0, found 0")

    def process_requests(self, world_size: int) -> int:
        """The most requests this process keeps in flight, one of `world_size` processes."""
        return process_share(self.max_requests, self.job_max_requests, world_size)

    def resolved_endpoint(self) -> str:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator and "://" not in emulator:
            emulator = f"http://{emulator}"
        return (self.endpoint_url or emulator or GOOGLE_ENDPOINT).rstrip("/")

    def is_anonymous(self) -> bool:
        if self.anonymous is not None:
            return self.anonymous
        return self.credentials is None and self.resolved_endpoint() != GOOGLE_ENDPOINT
