"""Real gloo ranks on each object store: each rank uploads its own objects and the coordinator
commits; DTensor shards reshard on load through ranged reads of the parts each rank needs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import uvloop
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from asynctron import Engine
from asynctron._launch import run_local_ranks
from tests.objects.conftest import Store

pytestmark = pytest.mark.slow

ROWS, COLS = 64, 4096


def _full() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))


def save_and_reshard(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}

    async def run() -> None:
        async with Engine() as engine:
            state = {"dt": distribute_tensor(_full(), mesh, [Shard(0)]),
                     f"own{rank}": torch.full((1000,), float(rank)), "step": 9}
            out["files"] = (await engine.save(state, f"{root}/step_9")).files
            for name, placement in (("rows", Shard(0)), ("cols", Shard(1)),
                                    ("replicated", Replicate())):
                target = {"dt": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [placement])}
                loaded = await engine.load_into(target, root)
                out[name] = torch.equal(loaded["dt"].full_tensor(), _full())

    uvloop.run(run())
    return out


def test_ranks_upload_their_own_objects_and_reshard_on_load(store: Store) -> None:
    results = [r.unwrap() for r in run_local_ranks(save_and_reshard, 2, store.root,
                                                    timeout_s=240)]
    assert all(f.startswith("__0_") for f in results[0]["files"])
    assert all(f.startswith("__1_") for f in results[1]["files"])
    for result in results:
        assert result["rows"] and result["cols"] and result["replicated"]
    keys = store.keys_under(store.root)
    assert {key.split("/")[0] for key in keys} == {"latest", "step_9"}
    assert "step_9/manifest.json" in keys
