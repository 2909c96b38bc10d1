"""Azurite, the test Azure Blob server: it starts, serves its container to the SDK, stops."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import skip_without_azurite


async def _slices(view: memoryview, size: int = 256 << 10) -> AsyncIterator[memoryview]:
    """A body aiohttp sends without copying or warning (a bytes body over 1 MiB warns)."""
    for start in range(0, view.nbytes, size):
        yield view[start:start + size]


async def test_put_get_with_the_sdk(azurite_server: Any) -> None:
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob.aio import BlobServiceClient

    data = memoryview(os.urandom(3 << 20))
    half = data.nbytes // 2
    connection = azurite_server.environment()["AZURE_STORAGE_CONNECTION_STRING"]
    async with BlobServiceClient.from_connection_string(connection, retry_total=0) as client:
        blob = client.get_blob_client(azurite_server.container, "test_azurite/put_get")
        await blob.stage_block("block-0", _slices(data[:half]), length=half)
        await blob.stage_block("block-1", _slices(data[half:]), length=data.nbytes - half)
        await blob.commit_block_list(["block-0", "block-1"], metadata={"kind": "probe"},
                                     match_condition=MatchConditions.IfMissing)
        assert await (await blob.download_blob()).readall() == data
        part = await (await blob.download_blob(offset=half - 10, length=20)).readall()
        assert part == data[half - 10:half + 10]
        assert (await blob.get_blob_properties()).metadata == {"kind": "probe"}
        with pytest.raises(ResourceExistsError):
            await blob.upload_blob(b"again", overwrite=False)
        await blob.delete_blob()


def test_start_and_stop(tmp_path: Any) -> None:
    """A server of its own (besides the session's) creates its container and, once stopped,
    has exited and no longer answers."""
    skip_without_azurite()
    from azure.storage.blob import BlobServiceClient

    from asynctron.testing.azurite import Azurite

    with (Azurite.start(str(tmp_path), container="other") as server,
          BlobServiceClient.from_connection_string(server.connection_string,
                                                   retry_total=0) as client):
        assert [c.name for c in client.list_containers()] == ["other"]
    assert server.process.returncode is not None
    with pytest.raises(OSError):
        urllib.request.urlopen(server.endpoint + "?comp=list", timeout=1)
    server.stop()  # again: nothing
