"""`AzureConfig`: which storage account, who we are, and how hard to push it.

Everything left None comes from Azure's standard settings, as its SDK's users expect:
`AZURE_STORAGE_CONNECTION_STRING`; else the account `AZURE_STORAGE_ACCOUNT_NAME` (its
endpoint `https://<name>.blob.core.windows.net`, or `AZURE_STORAGE_ACCOUNT_URL`) with
`AZURE_STORAGE_ACCOUNT_KEY`, or, without a key, azure-identity's DefaultAzureCredential
(environment, workload or managed identity, the Azure CLI) when azure-identity is installed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from asynctron._knobs import store_deadline_s, store_job_requests
from asynctron.storage.backends.objects._request_budget import process_share

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class AzureConfig:
    """How asynctron reaches an Azure Blob Storage account. Validated at construction."""

    connection_string: str | None = None
    """An account's connection string (Azurite's, or one with `AccountKey=` or a SAS)."""
    account_url: str | None = None
    """The blob endpoint (`https://<account>.blob.core.windows.net`)."""
    account_name: str | None = None
    account_key: str | None = None
    credential: Any = None
    """Any credential the SDK takes (a TokenCredential); None: the key, else
    DefaultAzureCredential."""
    max_requests: int = 64
    """Most requests in flight at once from this process (the request budget)."""
    job_max_requests: int | None = field(default_factory=store_job_requests)
    """Most requests in flight from the whole job; each process takes its share. Default:
    `ASYNCTRON_STORE_JOB_REQUESTS`, else None."""
    single_put_bytes: int = 8 * MiB
    """Files up to this size go as one Put Blob, larger ones as staged blocks."""
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
                raise ValueError(f"AzureConfig.{name}: expected a positive int, found {value!r}")
        for name in ("deadline_s", "connect_timeout_s", "read_timeout_s", "abandoned_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"AzureConfig.{name}: expected seconds >= 0, found {value!r}")
        if self.deadline_s == 0:
            raise ValueError("AzureConfig.deadline_s: expected seconds > 0, found 0")

    def process_requests(self, world_size: int) -> int:
        """The most requests this process keeps in flight, one of `world_size` processes."""
        return process_share(self.max_requests, self.job_max_requests, world_size)

    def resolved(self) -> tuple[str, str | None, str | None, Any]:
        """The account's blob endpoint, name and key, and the credential for requests (a
        connection string's, else the key, else `credential`, else DefaultAzureCredential).

        Raises:
            ValueError: nothing names an account (naming what to set), or no credential
                is found and azure-identity is not installed.
        """
        text = self.connection_string or (
            None if self.account_url or self.account_name
            else os.environ.get("AZURE_STORAGE_CONNECTION_STRING"))
        if text:
            parts = _connection_string(text)
            name = parts.get("accountname")
            url = parts.get("blobendpoint") or (
                f"{parts.get('defaultendpointsprotocol', 'https')}://{name}.blob."
                f"{parts.get('endpointsuffix', 'core.windows.net')}" if name else None)
            if url is None:
                raise ValueError("AzureConfig.connection_string: expected AccountName= or "
                                 "BlobEndpoint= in it, found neither")
            key = parts.get("accountkey")
            credential = ({"account_name": name, "account_key": key} if key
                          else parts.get("sharedaccesssignature"))
            return url.rstrip("/"), name, key, credential
        name = self.account_name or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        url = self.account_url or os.environ.get("AZURE_STORAGE_ACCOUNT_URL") or (
            f"https://{name}.blob.core.windows.net" if name else None)
        if url is None:
            raise ValueError(
                "Azure Blob: no account configured; set AZURE_STORAGE_CONNECTION_STRING, or "
                "AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_ACCOUNT_KEY, or a credential "
                "DefaultAzureCredential finds), or pass AzureConfig(...)")
        key = self.account_key or os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
        if key:
            name = name or url.split("//", 1)[-1].split(".", 1)[0]
            return url.rstrip("/"), name, key, {"account_name": name, "account_key": key}
        if self.credential is not None:
            return url.rstrip("/"), name, None, self.credential
        try:
            from azure.identity.aio import DefaultAzureCredential
        except ImportError:
            raise ValueError(
                f"Azure Blob account {url}: no key and no credential; set "
                "AZURE_STORAGE_ACCOUNT_KEY (or a connection string), pass "
                "AzureConfig(credential=...), or install azure-identity for "
                "DefaultAzureCredential") from None
        return url.rstrip("/"), name, None, DefaultAzureCredential()


def _connection_string(text: str) -> dict[str, str]:
    """`Key=value;...` as lower-cased keys (values keep their `=`: keys are base64)."""
    parts = {}
    for part in text.split(";"):
        key, found, value = part.strip().partition("=")
        if found:
            parts[key.strip().lower()] = value.strip()
    return parts
