"""Tiers across real gloo ranks holding FSDP2 state (`fully_shard`, AdamW, `get_state_dict`),
several "nodes" on this machine (`ASYNCTRON_RANKS_PER_NODE`, a `{node}` local tier each):
replicas on the next node, a node lost (its tier deleted, its ranks killed) restored from the
other node, damaged shards skipped item by item, two nodes lost restored from the store, a node
lost mid-save, a drain killed midway. Every restore is checked bit for bit (each tensor's
whole bytes) against the step it names, retrained from scratch."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from typing import Any

import pytest
import uvloop

import asynctron
from asynctron import Engine, PeerError, Tiers
from asynctron._launch import run_local_ranks
from asynctron.testing import FaultyBackend
from asynctron.testing.layouts import Job, build, full_digests

pytestmark = pytest.mark.slow

SMALL = {"slab_bytes": 256 << 10, "memory_budget_bytes": 1 << 20}


def state_of(rank: int, job: Job, step: int) -> dict[str, Any]:
    """A rank's state at `step`: the FSDP2 model's and optimizer's, and per-rank JSON values
    under keys every rank uses (a loader's cursor)."""
    return {**job.state(), "cursor": {"rank": rank, "consumed": 16 * step}, "step": step}


def trained(per_node: int, step: int) -> Job:
    """This test's FSDP2 job trained to `step` (the same on every run: collective)."""
    job = build("fsdp", per_node=per_node)
    for done in range(1, step + 1):
        job.train_step(done)
    return job


def empty(per_node: int) -> Job:
    """A fresh job (other weights), its optimizer's state made, to restore into."""
    job = build("fsdp", per_node=per_node, seed=7)
    job.init_optimizer_state()
    return job


def exact(rank: int, per_node: int, step: int, target: Job, values: dict[str, Any]) -> bool:
    """Collective: `target` holds `step`'s state bit for bit, and `values` its values."""
    return (full_digests(target.state()) == full_digests(trained(per_node, step).state())
            and values["cursor"] == {"rank": rank, "consumed": 16 * step}
            and values["step"] == step)


async def save_steps(rank: int, per_node: int, engine: Engine, steps: list[int]) -> list[int]:
    """Train a fresh job to the last of `steps`, saving each of them."""
    job = build("fsdp", per_node=per_node)
    saved = []
    for step in range(1, max(steps) + 1):
        job.train_step(step)
        if step in steps:
            saved.append((await engine.save(state_of(rank, job, step), step=step)).step)
    return saved


async def restore_into(rank: int, per_node: int, engine: Engine) -> dict[str, Any]:
    """Restore into a fresh job; what was found, and whether it is exact."""
    target = empty(per_node)
    result = await engine.restore(state_of(rank, target, -1))
    target.load(result.state)
    return {"step": result.step, "sources": result.sources, "skipped": result.skipped,
            "exact": exact(rank, per_node, result.step, target, result.state)}


def tiers_of(root: str, **fields: Any) -> Tiers:
    return Tiers(**{"local": f"{root}/node{{node}}", "store": f"{root}/store", "replicas": 1,
                    "store_every": 2, "keep_local": 2, **fields})


def run(rank: int, world: int, root: str, per_node: int, action: str,
        steps: list[int], fields: dict[str, Any]) -> Any:
    """One rank's part: save `steps`, or restore (then report what it found)."""
    os.environ["ASYNCTRON_RANKS_PER_NODE"] = str(per_node)
    tiers = tiers_of(root, **fields)

    async def main() -> Any:
        async with Engine(tiers=tiers, **SMALL) as engine:
            if action == "save":
                return await save_steps(rank, per_node, engine, steps)
            return await restore_into(rank, per_node, engine)

    return uvloop.run(main())


def _ranks(world: int, root: str, per_node: int, action: str, steps: list[int] = (),
           **fields: Any) -> list[Any]:
    return [r.unwrap() for r in run_local_ranks(run, world, root, per_node, action,
                                                list(steps), fields, timeout_s=240)]


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def test_replicas_serve_lost_and_damaged_shards_and_the_store_serves_two_lost_nodes(
        tmp_path: Any) -> None:
    """4 ranks as 2 nodes of 2, one replica each: every node holds its ranks' shards and the
    replicas of the other node's; what a node lost or damaged is restored from the other
    node's copy, item by item; with both nodes lost, from the store."""
    root = str(tmp_path)
    assert _ranks(4, root, 2, "save", range(1, 5)) == [[1, 2, 3, 4]] * 4
    for node in (0, 1):
        assert sorted(os.listdir(f"{root}/node{node}")) == sorted(
            f"step_0000000{step}.rank_0000{rank}.of_00004" for step in (3, 4)
            for rank in range(4))
    assert {"step_00000002", "step_00000004"} <= set(os.listdir(f"{root}/store"))

    _flip(f"{root}/node0/step_00000004.rank_00000.of_00004/__0_0.distcp", 4096)
    os.truncate(f"{root}/node1/step_00000004.rank_00003.of_00004/__3_0.distcp", 100)
    found = _ranks(4, root, 2, "restore")
    assert all(f["step"] == 4 and f["exact"] for f in found), found
    # rank 3's shard (holding also node 1's copy of some of rank 2's replicated items) from
    # node 0: rank 0's replica of its shard, node 0's own copy of the replicated items
    assert found[0]["sources"] == ("replica", "local", "replica", "replica")
    assert "node0/step_00000004.rank_00000" in found[0]["skipped"][0]
    assert "expected xxh3_64" in found[0]["skipped"][0]

    # the replica damaged too: rank 0 finds it where the bytes land, and takes the store's
    _flip(f"{root}/node1/step_00000004.rank_00000.of_00004/__0_0.distcp", 4096)
    found = _ranks(4, root, 2, "restore")
    assert all(f["step"] == 4 and f["exact"] for f in found), found
    assert found[0]["sources"] == ("store", "local", "replica", "replica")
    assert any("rank 2's node" in why and "received" in why for why in found[0]["skipped"])

    # node 1 lost with its disk (a new one comes up empty); a restore writes nothing, so
    # rank 0's damaged item is still damaged on node 0: that item alone from the store
    shutil.rmtree(f"{root}/node1")
    found = _ranks(4, root, 2, "restore")
    assert all(f["step"] == 4 and f["exact"] for f in found), found
    assert found[0]["sources"] == ("store", "local", "replica", "replica")

    shutil.rmtree(f"{root}/node0")  # node 1's new disk is still empty
    found = _ranks(4, root, 2, "restore")
    assert all(f["step"] == 4 and f["exact"] for f in found), found
    assert found[0]["sources"] == ("store",) * 4


def lose_a_node_mid_save(rank: int, world: int, root: str) -> Any:
    """Rank 1 (node 1) dies, SIGKILLed, while its shard of step 3 is being written."""
    os.environ["ASYNCTRON_RANKS_PER_NODE"] = "1"
    tiers = tiers_of(root, store=None)
    backend = FaultyBackend()

    async def main() -> Any:
        async with Engine(tiers=tiers, backend=backend, **SMALL) as engine:
            job = build("fsdp", per_node=1)
            for step in (1, 2):
                job.train_step(step)
                await engine.save(state_of(rank, job, step), step=step)
            job.train_step(3)
            if rank == 1:
                gate = backend.hold("write", where="step_00000003.rank_00001.of_00002")
                threading.Thread(target=lambda: (gate.wait_reached(60),
                                                 os.kill(os.getpid(), signal.SIGKILL)),
                                 daemon=True).start()
            try:
                await engine.save(state_of(rank, job, 3), step=3)
            except PeerError as error:
                return f"PeerError: {error}"
            return "saved"

    return uvloop.run(main())


def test_a_node_lost_mid_save_leaves_the_previous_step_restorable(tmp_path: Any) -> None:
    root = str(tmp_path)
    results = run_local_ranks(lose_a_node_mid_save, 2, root, timeout_s=240)
    assert results[1].exitcode == -signal.SIGKILL
    assert results[0].unwrap().startswith("PeerError: ")
    shutil.rmtree(f"{root}/node1")
    found = _ranks(2, root, 1, "restore", store=None)
    assert all(f["step"] == 2 and f["exact"] for f in found), found
    assert found[0]["sources"] == ("local", "replica")


def kill_the_drain(rank: int, world: int, root: str) -> Any:
    """Every rank saves steps 1-2; rank 0 is SIGKILLed as the drain of step 2 commits."""
    os.environ["ASYNCTRON_RANKS_PER_NODE"] = "1"
    store = FaultyBackend()
    if rank == 0:
        gate = store.hold("commit", where="step_00000002")
        threading.Thread(target=lambda: (gate.wait_reached(120),
                                         os.kill(os.getpid(), signal.SIGKILL)),
                         daemon=True).start()

    async def main() -> Any:
        async with Engine(tiers=tiers_of(root), store_backend=store, **SMALL) as engine:
            await save_steps(rank, 1, engine, [1, 2])
        return "closed"

    return uvloop.run(main())


def test_a_drain_killed_midway_leaves_no_checkpoint_in_the_store(tmp_path: Any) -> None:
    root = str(tmp_path)
    results = run_local_ranks(kill_the_drain, 2, root, timeout_s=240)
    assert results[0].exitcode == -signal.SIGKILL
    assert results[1].unwrap() == "closed"  # the drain failed there: logged, not raised
    assert "step_00000002" not in os.listdir(f"{root}/store")
    with pytest.raises(asynctron.CheckpointNotFoundError):
        asynctron.load(f"{root}/store")
    assert _ranks(2, root, 1, "save", [3, 4]) == [[3, 4]] * 2
    assert sorted(os.listdir(f"{root}/store")) == ["latest", "step_00000004"]  # debris swept
    found = _ranks(2, root, 1, "restore")
    assert all(f["step"] == 4 and f["exact"] for f in found), found
