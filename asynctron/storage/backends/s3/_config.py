"""`S3Config`: where the store is, who we are, and how hard to push it.

Everything left None comes from the standard AWS chain, as boto3 users expect: the endpoint
from `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` or the profile's `endpoint_url`; credentials
from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (/ `AWS_SESSION_TOKEN`), `AWS_PROFILE` and
the config and credentials files, or an instance role; the region from `AWS_REGION` /
`AWS_DEFAULT_REGION` or the profile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from asynctron.storage.backends.objects._store_config import StoreConfig


@dataclass(frozen=True, slots=True)
class S3Config(StoreConfig):
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

    def __post_init__(self) -> None:
        StoreConfig.__post_init__(self)
        if self.addressing_style not in (None, "path", "virtual", "auto"):
            raise ValueError("S3Config.addressing_style: expected 'path', 'virtual', 'auto' "
                             f"or None, found {self.addressing_style!r}")

    def resolved_endpoint(self) -> str | None:
        """The endpoint requests go to: this config's, else the environment's (None: the one
        botocore derives from the profile, or AWS's for the region)."""
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None)

    def resolved_addressing_style(self) -> str:
        if self.addressing_style is not None:
            return self.addressing_style
        return "path" if self.resolved_endpoint() else "auto"

