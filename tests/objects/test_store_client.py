"""The `ObjectClient` contract, on each real store: what the commit protocol relies on (a
create that fails over an existing object, a replace only over the version read), ranged
reads into buffers, listings one level deep or at any depth, and uploads in parts that are
invisible until completed and leave nothing once aborted."""

from __future__ import annotations

import pytest

from asynctron.errors import ObjectNotFoundError
from asynctron.storage.backends.objects import (
    ObjectClient,
    ObjectUrl,
    PreconditionFailedError,
)
from asynctron.storage.backends.objects._layout import parse_url
from tests.objects.conftest import Store

MiB = 1 << 20


def _client(store: Store) -> tuple[ObjectClient, ObjectUrl]:
    client = store.backend(deadline_s=10).client
    assert isinstance(client, ObjectClient)
    return client, parse_url(store.root, client.schemes)


async def test_a_create_fails_over_an_existing_object_and_a_replace_over_another_version(
        store: Store) -> None:
    client, root = _client(store)
    url = root.child("commit-point")
    await client.put(url, b"first", if_none_match=True, metadata={"asynctron-save": "a1"})
    with pytest.raises(PreconditionFailedError, match="commit-point"):
        await client.put(url, b"second", if_none_match=True)
    info = await client.head(url)
    assert (info.size, info.metadata.get("asynctron-save")) == (5, "a1")
    data, version, size = await client.get_small(url, 1 << 10)
    assert (data, version, size) == (b"first", info.etag, 5)
    await client.put(url, b"third!", if_match=version)
    with pytest.raises(PreconditionFailedError):
        await client.put(url, b"lost update", if_match=version)
    assert (await client.get_small(url, 1 << 10))[0] == b"third!"
    assert (await client.get_small(url, 3))[0] is None  # larger than asked: unread


async def test_ranged_reads_land_in_the_callers_buffers(store: Store) -> None:
    client, root = _client(store)
    url = root.child("data")
    payload = bytes(range(256)) * (3 * MiB // 256)
    await client.put(url, payload)
    first, second = bytearray(1000), bytearray(MiB)
    await client.get_into(url, 12345, [memoryview(first), memoryview(second)])
    assert bytes(first + second) == payload[12345:12345 + 1000 + MiB]
    with pytest.raises(ObjectNotFoundError):
        await client.get_into(root.child("absent"), 0, [memoryview(bytearray(4))])


async def test_listings_one_level_deep_or_at_any_depth(store: Store) -> None:
    client, root = _client(store)
    for name in ("a", "b", "sub/c", "sub/deeper/d"):
        await client.put(root.child(name), name.encode())
    shallow = await client.list(root)
    assert sorted(shallow.sizes) == ["a", "b"] and shallow.sizes["a"] == 1
    assert shallow.now is not None and shallow.age_s("a") > -1.5  # its Date: whole seconds
    deep = await client.list(root, recursive=True)
    assert sorted(deep.sizes) == ["a", "b", "sub/c", "sub/deeper/d"]
    await client.delete([root.child("a"), root.child("never-there")])
    assert sorted((await client.list(root)).sizes) == ["b"]


async def test_an_upload_in_parts_is_invisible_until_completed(store: Store) -> None:
    client, root = _client(store)
    url = root.child("big")
    part = client.limits.least_part_bytes(3 * MiB)
    bodies = [bytes([number]) * part for number in range(1, 4)]
    upload = await client.start_upload(url)
    tags = [await client.upload_part(url, upload, number, body)
            for number, body in enumerate(bodies, 1)]
    assert "big" not in (await client.list(root)).sizes
    assert [found.key for found in await client.list_uploads(root)] == [url.key]
    await client.complete_upload(url, upload, tags)
    assert (await client.get_small(url, 4 * part))[0] == b"".join(bodies)
    assert await client.list_uploads(root) == []
    assert sorted((await client.list(root)).sizes) == ["big"]


async def test_an_aborted_upload_leaves_nothing_and_never_touches_the_object(
        store: Store) -> None:
    client, root = _client(store)
    fresh, existing = root.child("fresh"), root.child("existing")
    await client.put(existing, b"keep me")
    for url in (fresh, existing):
        upload = await client.start_upload(url)
        await client.upload_part(url, upload, 1, b"x" * client.limits.min_part_bytes)
        await client.abort_upload(url, upload)
    assert await client.list_uploads(root) == []
    assert sorted((await client.list(root)).sizes) == ["existing"]
    assert (await client.get_small(existing, 100))[0] == b"keep me"
