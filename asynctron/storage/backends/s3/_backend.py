"""`S3Backend`: the object-store backend over an `S3Client`."""

from __future__ import annotations

from asynctron.storage.backends.objects import ObjectStoreBackend
from asynctron.storage.backends.s3._client import S3Client
from asynctron.storage.backends.s3._config import S3Config


class S3Backend(ObjectStoreBackend):
    """Checkpoints and datasets on an S3-compatible store (`s3://bucket/key`), configured by
    `config` (default: the AWS chain's store and credentials)."""

    client: S3Client
    config: S3Config

    def __init__(self, config: S3Config | None = None) -> None:
        super().__init__(S3Client(config or S3Config()))
