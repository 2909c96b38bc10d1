"""`GcsBackend`: the object-store backend over a `GcsClient`."""

from __future__ import annotations

from asynctron.storage.backends.gcs._client import GcsClient
from asynctron.storage.backends.gcs._config import GcsConfig
from asynctron.storage.backends.objects import ObjectStoreBackend


class GcsBackend(ObjectStoreBackend):
    """Checkpoints and datasets on Google Cloud Storage (`gs://bucket/key`), configured by
    `config` (default: Google's standard settings)."""

    client: GcsClient
    config: GcsConfig

    def __init__(self, config: GcsConfig | None = None) -> None:
        super().__init__(GcsClient(config or GcsConfig()))
