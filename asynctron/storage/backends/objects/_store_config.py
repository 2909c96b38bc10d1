"""`StoreConfig`: the settings every object store's config has (`S3Config`, `AzureConfig`,
`GcsConfig` add where the store is and who we are)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from asynctron._knobs import store_deadline_s, store_job_requests
from asynctron.storage.backends.objects._request_budget import process_share

MiB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How hard to push a store, and how long to wait for it. Validated at construction
    (errors name the config class and the field)."""

    max_requests: int = 64
    """Most requests to the store in flight at once from this process (the request budget;
    throttling shrinks it while the store asks, see `RequestBudget`)."""
    job_max_requests: int | None = field(default_factory=store_job_requests)
    """Most requests in flight at this store from the whole job: each process takes its share
    (`job_max_requests // world size`, at least 1, at most `max_requests`; the world size is
    torch.distributed's, else `WORLD_SIZE`'s, when the client starts). Default:
    `ASYNCTRON_STORE_JOB_REQUESTS`, else None (each process `max_requests`)."""
    single_put_bytes: int = 8 * MiB
    """Files up to this size go as one request, larger ones as an upload in parts."""
    deadline_s: float = field(default_factory=store_deadline_s)
    """How long an operation (a save, a load, a dataset read) goes on while the store answers
    none of its requests (resets, timeouts, 5xx and throttling retried with backoff
    meanwhile); then it fails, and so do all its requests. Default:
    `ASYNCTRON_STORE_DEADLINE_S`, else 60."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    abandoned_after_s: float = 3600.0
    """A save on another host whose claim is older than this is taken for dead: the next
    commit under its root deletes its objects and aborts its uploads. A dead save on this host
    is found at once (its process is gone)."""

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for name in ("max_requests", "single_put_bytes", "job_max_requests"):
            value = getattr(self, name)
            if value is None and name == "job_max_requests":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{kind}.{name}: expected a positive int, found {value!r}")
        for name in ("deadline_s", "connect_timeout_s", "read_timeout_s", "abandoned_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"{kind}.{name}: expected seconds >= 0, found {value!r}")
        if self.deadline_s == 0:
            raise ValueError(f"{kind}.deadline_s: expected seconds > 0, found 0")

    def process_requests(self, world_size: int) -> int:
        """The most requests this process keeps in flight, one of `world_size` processes."""
        return process_share(self.max_requests, self.job_max_requests, world_size)
