"""Every save and load path on the state large jobs hold (FSDP2, and tensor parallel with FSDP2,
from `get_state_dict`), across 4 real gloo ranks: a multi-rank `Engine.save` loaded back in
place, its DCP format loaded by stock `dcp.load`, the DCP plugins both ways, stock `dcp.load`
of an asynctron-format checkpoint through the plugin's reader, and `BackgroundEngine` saving
to the tiers and restoring. Each compared bit for bit, by each tensor's whole bytes."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
import uvloop

import asynctron
from asynctron import BackgroundEngine, Engine, Tiers
from asynctron._launch import run_local_ranks
from asynctron.testing.layouts import Job, build, full_digests

pytestmark = pytest.mark.slow

SMALL = {"slab_bytes": 256 << 10, "memory_budget_bytes": 4 << 20}


def _fresh(layout: str) -> Job:
    job = build(layout, per_node=2, seed=7)
    job.init_optimizer_state()
    return job


def every_path(rank: int, world: int, root: str) -> dict[str, Any]:
    """For FSDP2 and TP + FSDP2: the saved state's digests, and each path's loaded ones."""
    os.environ["ASYNCTRON_RANKS_PER_NODE"] = "2"
    found: dict[str, Any] = {}
    for layout in ("fsdp", "tp"):
        job = build(layout, per_node=2)
        job.train_step(1)
        state = job.state()
        loaded: dict[str, Any] = {"saved": full_digests(state)}
        base = f"{root}/{layout}"

        async def engine_paths(state: dict[str, Any] = state, base: str = base,
                               loaded: dict[str, Any] = loaded, layout: str = layout) -> None:
            async with Engine(**SMALL) as engine:
                await engine.save(state, f"{base}/native")
                await engine.save(state, f"{base}/dcp-format", format="dcp")
                target = _fresh(layout)
                restored = await engine.load_into(target.state(), f"{base}/native")
                target.load(restored)
                loaded["load_into"] = full_digests(target.state())

        uvloop.run(engine_paths())
        for name, reader in (("stock dcp.load of format='dcp'", None),
                             ("dcp.load of the native format through the plugin",
                              asynctron.dcp.StorageReader(f"{base}/native"))):
            target = _fresh(layout)
            into = target.state()
            if reader is None:
                dcp.load(into, checkpoint_id=f"{base}/dcp-format")
            else:
                dcp.load(into, storage_reader=reader)
            target.load(into)
            loaded[name] = full_digests(target.state())
        dcp.save(state, storage_writer=asynctron.dcp.StorageWriter(f"{base}/plugin"))
        target = _fresh(layout)
        into = target.state()
        dcp.load(into, storage_reader=asynctron.dcp.StorageReader(f"{base}/plugin"))
        target.load(into)
        loaded["the DCP plugins"] = full_digests(target.state())
        tiers = Tiers(local=f"{base}/tiers/node{{node}}", store=f"{base}/tiers/store",
                      store_every=1)
        with BackgroundEngine(tiers=tiers, **SMALL) as engine:
            assert engine.save({**state, "step": 1}, step=1).result().step == 1
        target = _fresh(layout)
        with BackgroundEngine(tiers=tiers, **SMALL) as engine:
            result = engine.restore({**target.state(), "step": 0})
        target.load(result.state)
        loaded["BackgroundEngine tiers"] = full_digests(target.state())
        found[layout] = loaded
    return found


def test_every_save_and_load_path_takes_fsdp2_and_tensor_parallel_state(tmp_path: Any) -> None:
    results = [r.unwrap() for r in run_local_ranks(every_path, 4, str(tmp_path), timeout_s=300)]
    for rank, found in enumerate(results):
        for layout, loaded in found.items():
            saved = results[0][layout]["saved"]
            assert len(loaded) == 6, loaded.keys()
            for path, digests in loaded.items():
                assert digests == saved, (rank, layout, path)
