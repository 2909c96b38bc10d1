"""`AzureConfig`: which storage account, who we are, and how hard to push it.

Everything left None comes from Azure's standard settings, as its SDK's users expect:
`AZURE_STORAGE_CONNECTION_STRING`; else the account `AZURE_STORAGE_ACCOUNT_NAME` (its
endpoint `https://<name>.blob.core.windows.net`, or `AZURE_STORAGE_ACCOUNT_URL`) with
`AZURE_STORAGE_ACCOUNT_KEY`, or, without a key, azure-identity's DefaultAzureCredential
(environment, workload or managed identity, the Azure CLI) when azure-identity is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from asynctron.storage.backends.objects._store_config import StoreConfig


@dataclass(frozen=True, slots=True)
class AzureConfig(StoreConfig):
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


_DEVELOPMENT_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
                    "KBHBeksoGMGw==")
"""The key of Azurite's (and the storage emulator's) one account, `devstoreaccount1`: public."""


def _connection_string(text: str) -> dict[str, str]:
    """`Key=value;...` as lower-cased keys (values keep their `=`: keys are base64); the SDK's
    `UseDevelopmentStorage=true` as the local emulator's account (at
    `DevelopmentStorageProxyUri=`, else http://127.0.0.1:10000), as the SDK reads it."""
    parts = {}
    for part in text.split(";"):
        key, found, value = part.strip().partition("=")
        if found:
            parts[key.strip().lower()] = value.strip()
    if parts.get("usedevelopmentstorage", "").lower() == "true":
        host = parts.get("developmentstorageproxyuri", "http://127.0.0.1").rstrip("/")
        parts = {"accountname": "devstoreaccount1", "accountkey": _DEVELOPMENT_KEY,
                 "blobendpoint": f"{host}:10000/devstoreaccount1"}
    return parts
