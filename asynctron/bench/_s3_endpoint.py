"""Checkpoint writers and readers on one S3 endpoint, for the multi-rank store benches
(`tiers`, `s3 --ranks`): asynctron's `S3Backend`, stock DCP's fsspec writer and reader on
s3fs, and s3torchconnector's DCP reader."""

from __future__ import annotations

import os
from typing import Any

from asynctron.storage.backends.s3 import S3Backend, S3Config


def s3_backend(endpoint: str) -> S3Backend:
    return S3Backend(S3Config(endpoint_url=endpoint))


def fsspec(url: str, endpoint: str, *, writing: bool) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    options = {"endpoint_url": endpoint,
               "client_kwargs": {"region_name": os.environ["AWS_REGION"]},
               "config_kwargs": {"s3": {"addressing_style": "path"}}}
    if writing:
        return FsspecWriter(url, sync_files=False, thread_count=4, **options)
    return FsspecReader(url, **options)


def s3torch(url: str, endpoint: str) -> Any:
    """s3torchconnector's reader (its CRT client takes the endpoint from AWS_ENDPOINT_URL)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    return S3StorageReader(os.environ["AWS_REGION"], url,
                           s3client_config=S3ClientConfig(force_path_style=True))
