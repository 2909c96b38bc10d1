"""The DCP plugins on each object store, interrupted (Ctrl-C) while `StorageWriter.finish`
waits for the commit: the commit goes on to its end on the runtime's loop, never split."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asynctron.dcp import StorageReader, StorageWriter
from asynctron.storage.backends.objects import ObjectStoreBackend
from asynctron.testing import GatedObjectClient
from tests.conftest import assert_same, interrupted_once_reached
from tests.objects.conftest import Store


@pytest.mark.parametrize("point", [".metadata", "manifest.json"])
def test_an_interrupt_in_finish_on_a_store_never_splits_the_commit(
        store: Store, point: str) -> None:
    """Ctrl-C reaches `dcp.save` while `finish` waits and a commit point's PUT is held
    (`.metadata`: the first, before the checkpoint is committed; `manifest.json`: the last,
    with `.metadata` already up): once the runtime is idle the checkpoint is whole (both
    commit points, every data file) and loads bit for bit, its claim is gone, and no upload
    is left open. The interrupt neither aborts the commit half way nor discards its objects."""
    client = GatedObjectClient(store.backend(deadline_s=30).client)
    backend = ObjectStoreBackend(client)
    held = client.hold("put", where=lambda url: url.key.endswith(f"/ck/{point}"))
    torch.manual_seed(0)
    state = {"w": torch.randn(1 << 20), "v": torch.randn(5000), "step": torch.tensor(3)}
    path = f"{store.root}/ck"
    writer = StorageWriter(path, backend=backend)
    with pytest.raises((KeyboardInterrupt, CheckpointException)), interrupted_once_reached(held):
        dcp.save(state, storage_writer=writer)
    concurrent.futures.wait(list(writer._started()._in_flight))
    keys = store.keys_under(store.root)
    assert {"ck/.metadata", "ck/manifest.json"} <= set(keys), keys
    assert not [key for key in keys if key.startswith(".")], keys  # the claim is gone
    assert [key for key in keys if not key.startswith("ck/")] == [], keys
    assert store.uploads_under(store.root) == []
    target = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(target, storage_reader=StorageReader(path, backend=store.backend()))
    assert_same(state, target)
