"""`AzureBackend`: the object-store backend over an `AzureClient`."""

from __future__ import annotations

from asynctron.storage.backends.azure._client import AzureClient
from asynctron.storage.backends.azure._config import AzureConfig
from asynctron.storage.backends.objects import ObjectStoreBackend


class AzureBackend(ObjectStoreBackend):
    """Checkpoints and datasets on Azure Blob Storage (`az://container/key`, `abfs://`),
    configured by `config` (default: the account Azure's standard settings name)."""

    client: AzureClient
    config: AzureConfig

    def __init__(self, config: AzureConfig | None = None) -> None:
        super().__init__(AzureClient(config or AzureConfig()))
