"""`GcsConfig`: where Google Cloud Storage is, who we are, and how hard to push it.

Left None, everything comes from Google's standard settings: the endpoint from
`STORAGE_EMULATOR_HOST` (an emulator: no credentials), else `https://storage.googleapis.com`
with Application Default Credentials (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud's, the
metadata server's) through google-auth.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from asynctron.storage.backends.objects._store_config import StoreConfig

GOOGLE_ENDPOINT = "https://storage.googleapis.com"


@dataclass(frozen=True, slots=True)
class GcsConfig(StoreConfig):
    """How asynctron reaches Google Cloud Storage (JSON API). Validated at construction."""

    endpoint_url: str | None = None
    """None: `STORAGE_EMULATOR_HOST`, else Google's."""
    credentials: Any = None
    """google-auth credentials; None: Application Default Credentials (none for an emulator)."""
    anonymous: bool | None = None
    """Send no credentials; None: to an endpoint other than Google's (an emulator), unless
    `credentials` are given."""

    def resolved_endpoint(self) -> str:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator and "://" not in emulator:
            emulator = f"http://{emulator}"
        return (self.endpoint_url or emulator or GOOGLE_ENDPOINT).rstrip("/")

    def is_anonymous(self) -> bool:
        if self.anonymous is not None:
            return self.anonymous
        return self.credentials is None and self.resolved_endpoint() != GOOGLE_ENDPOINT
