"""Checkpoints across real gloo ranks: every rank writes its share, the coordinator commits only
if all succeeded, replicated tensors are written once, DTensor shards reshard N → M on load, an
unchanged structure skips the plan collectives, collective loads share one look-up and fail
together, and stock DCP reads and writes with asynctron.

Three spawned runs keep the suite fast: 4 ranks save a sharded checkpoint; 2 ranks run every
scenario (and load the 4-rank checkpoint); 2 ranks test a rank SIGKILLed mid-save.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import uvloop
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import asynctron
from asynctron import Engine, PeerError, StorageError
from asynctron._launch import run_local_ranks
from asynctron.testing import FaultyBackend

pytestmark = pytest.mark.slow

ROWS, COLS = 24, 10
WIDE = (8, 1 << 16)  # rows of 256 KiB: a column shard skips the other half of each


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _shared() -> dict[str, torch.Tensor]:
    """Tensors every rank holds identically (replicated, as in data parallel)."""
    return {f"layer{i}": torch.full((256, 64), float(i)) for i in range(6)}


def _wide() -> torch.Tensor:
    return torch.arange(WIDE[0] * WIDE[1], dtype=torch.float32).reshape(WIDE)


def _dtensor(mesh: Any, placement: Any, seed: int = 1) -> DTensor:
    return distribute_tensor(_full(seed), mesh, [placement])


def _manifest(path: str) -> dict[str, Any]:
    with open(f"{path}/manifest.json") as f:
        return json.load(f)


def save_four_ranks(rank: int, world: int, root: str) -> int:
    mesh = init_device_mesh("cpu", (world,))

    async def run() -> int:
        async with Engine() as engine:
            await engine.save({"dt": _dtensor(mesh, Shard(0)), "shared": _shared(),
                               "wide": distribute_tensor(_wide(), mesh, [Shard(0)]),
                               "step": 4}, f"{root}/four")
            return engine.rank

    return uvloop.run(run())


def two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}

    async def run() -> None:
        async with Engine(coordination_timeout_s=30) as engine:
            # Round trip: replicated tensors, a rank's own tensor, a JSON value.
            state = {"shared": _shared(), f"own{rank}": torch.full((3,), float(rank)),
                     "step": 7}
            result = await engine.save(state, f"{root}/plain")
            out["files"] = result.files
            loaded = await engine.load(f"{root}/plain")
            out["plain_ok"] = (all(torch.equal(loaded["shared"][k], v)
                                   for k, v in _shared().items())
                               and torch.equal(loaded["own0"], torch.zeros(3))
                               and torch.equal(loaded["own1"], torch.ones(3))
                               and loaded["step"] == 7)

            # Collective loads: rank 0 finds the checkpoint for both; its error is both
            # ranks' own; a rank whose load fails makes the other raise.
            outcomes = []
            for path, template in ((f"{root}/nothing", None),
                                   (f"{root}/plain", {f"own{rank}": torch.zeros(3 + rank)}),
                                   (f"{root}/plain", {f"own{rank}": torch.zeros(3)})):
                try:
                    if template is None:
                        await engine.load(path, collective=True)
                    else:
                        await engine.load_into(template, path, collective=True)
                    outcomes.append("ok")
                except Exception as error:
                    outcomes.append((type(error).__name__, getattr(error, "rank", None)))
            out["collective"] = outcomes

            # DTensor shards saved with their global offsets; resharded on load.
            await engine.save({"dt": _dtensor(mesh, Shard(0))}, f"{root}/dt")
            for name, placement in (("shard0", Shard(0)), ("shard1", Shard(1)),
                                    ("replicate", Replicate())):
                target = {"dt": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [placement])}
                await engine.load_into(target, f"{root}/dt")
                out[f"reshard_{name}"] = torch.equal(target["dt"].full_tensor(), _full(1))
            four = {"dt": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
                    "shared": {k: torch.zeros_like(v) for k, v in _shared().items()}}
            await engine.load_into(four, f"{root}/four")  # saved by 4 ranks, loaded by 2
            out["four_to_two"] = torch.equal(four["dt"].full_tensor(), _full(1)) and all(
                torch.equal(four["shared"][k], v) for k, v in _shared().items())
        # Each rank reads only the bytes its own shard needs: half of each tensor, saved as
        # row chunks and wanted as row or column shards.
        counting = FaultyBackend()
        async with Engine(backend=counting, coordination_timeout_s=30) as engine:
            halves = {"dt": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
                      "wide": distribute_tensor(torch.zeros(WIDE), mesh, [Shard(1)])}
            await engine.load_into(halves, f"{root}/four")
            out["four_to_two_bytes_read"] = counting.bytes_read
            out["four_to_two_halves_ok"] = (
                torch.equal(halves["dt"].full_tensor(), _full(1))
                and torch.equal(halves["wide"].full_tensor(), _wide()))
        async with Engine(coordination_timeout_s=30) as engine:

            # Plan cache: an unchanged structure skips the plan collectives.
            calls = []
            for step in (1, 2, 3):
                before = engine.num_coordination_calls
                await engine.save({"w": torch.full((64,), float(step)), "step": step},
                                  f"{root}/cache_{step}")
                calls.append(engine.num_coordination_calls - before)
            out["calls"] = calls
            out["hits"] = engine.plan_cache.statistics().num_hits

            # Stock DCP writes, asynctron reads (into DTensors); asynctron writes DCP's format,
            # stock DCP reads.
            dcp.save({"dt": _dtensor(mesh, Shard(0), seed=2), "shared": _shared()},
                     checkpoint_id=f"{root}/stock")
            target = {"dt": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)])}
            await engine.load_into(target, f"{root}/stock")
            out["stock_to_asynctron"] = torch.equal(target["dt"].full_tensor(), _full(2))
            await engine.save({"dt": _dtensor(mesh, Shard(0), seed=3), "shared": _shared()},
                              f"{root}/ours_dcp", format="dcp")
            target = {"dt": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
                      "shared": {k: torch.zeros_like(v) for k, v in _shared().items()}}
            dcp.load(target, checkpoint_id=f"{root}/ours_dcp")
            out["asynctron_to_stock"] = torch.equal(target["dt"].full_tensor(), _full(3)) and (
                all(torch.equal(target["shared"][k], v) for k, v in _shared().items()))

        # Several saves in flight while the ranks run at different speeds (rank 1's fsyncs are
        # slow): each rank issues the protocol's collectives in the same order; all commit.
        slow = FaultyBackend(fsync_delay_s=0.2 if rank == 1 else 0.0)
        async with Engine(backend=slow, coordination_timeout_s=60) as engine:
            tasks = [engine.save({f"w{rank}": torch.full((1000,), float(step)), "step": step},
                                 f"{root}/overlap/step_{step}") for step in range(1, 5)]
            out["overlap"] = [(await task).path.rsplit("/", 1)[1] for task in tasks]

        # The coordinator fails between collectives (its tmp dir cannot be made: the parent is
        # a file; DCP's global step refuses a key that is a tensor on one rank and bytes on
        # another): the others raise at once instead of waiting out the timeout, and the next
        # save still works.
        async with Engine(coordination_timeout_s=30) as engine:
            if rank == 0:
                with open(f"{root}/not-a-dir", "w") as f:
                    f.write("x")
            started = asyncio.get_running_loop().time()
            mismatched = {"w": torch.ones(3) if rank == 0 else b"bytes"}
            for name, state, path in (
                    ("tmp_dir", {"w": torch.ones(3)}, f"{root}/not-a-dir/step_1"),
                    ("global_plan", mismatched, f"{root}/mismatched")):
                try:
                    await engine.save(state, path)
                    out[name] = "no error"
                except Exception as error:
                    out[name] = (type(error).__name__, getattr(error, "rank", None))
                    out[f"{name}_message"] = str(error)
            out["coordinator_failures_s"] = asyncio.get_running_loop().time() - started
            await engine.save({"w": torch.ones(3)}, f"{root}/after_failures")

        # A rank that fails mid-write: nothing is committed, every rank raises.
        faulty = FaultyBackend(enospc_after_bytes=4096) if rank == 1 else None
        async with Engine(backend=faulty, slab_bytes=1 << 16,
                          memory_budget_bytes=1 << 20) as engine:
            try:
                await engine.save({"shared": _shared()}, f"{root}/failed")
                out["failed"] = "no error"
            except (PeerError, StorageError) as error:
                out["failed"] = (type(error).__name__, getattr(error, "rank", None), str(error))

    uvloop.run(run())
    return out


@pytest.fixture(scope="module")
def four_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("ranks"))
    results = run_local_ranks(save_four_ranks, 4, root, timeout_s=180)
    assert [r.unwrap() for r in results] == [0, 1, 2, 3]
    return root


@pytest.fixture(scope="module")
def two_rank_results(four_rank_checkpoint: str) -> tuple[str, list[dict[str, Any]]]:
    root = four_rank_checkpoint
    results = run_local_ranks(two_ranks, 2, root, timeout_s=240)
    return root, [r.unwrap() for r in results]


def test_each_rank_writes_its_own_files_and_replicated_tensors_once(
        two_rank_results: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = two_rank_results
    assert all(r["plain_ok"] for r in results)
    assert all(f.startswith("__0_") for f in results[0]["files"])
    assert all(f.startswith("__1_") for f in results[1]["files"])
    items = _manifest(f"{root}/plain")["items"]
    shared = [i for i in items if i["key"].startswith("shared.")]
    assert sorted(i["key"] for i in shared) == sorted(f"shared.{k}" for k in _shared())
    writers = {i["file"].split("_")[2] for i in shared}
    assert writers == {"0", "1"}  # deduplicated, and spread over both ranks


def test_collective_loads_share_the_checkpoint_and_fail_together(
        two_rank_results: tuple[str, list[dict[str, Any]]]) -> None:
    _, results = two_rank_results
    assert results[0]["collective"] == [("CheckpointNotFoundError", None),
                                        ("PeerError", 1), "ok"]
    assert results[1]["collective"] == [("CheckpointNotFoundError", None),
                                        ("ValueError", None), "ok"]


def test_dtensor_shards_reshard_n_to_m(two_rank_results: tuple[str, list[dict[str, Any]]],
                                       four_rank_checkpoint: str) -> None:
    root, results = two_rank_results
    for r in results:
        assert r["reshard_shard0"] and r["reshard_shard1"] and r["reshard_replicate"]
        assert r["four_to_two_halves_ok"]
        assert r["four_to_two_bytes_read"] == (ROWS * COLS + WIDE[0] * WIDE[1]) * 4 // 2
        assert r["four_to_two"]
    chunks = [(i["chunk_offsets"], i["shape"]) for i in _manifest(f"{root}/four")["items"]
              if i["key"] == "dt"]
    assert sorted(chunks) == [([6 * k, 0], [6, COLS]) for k in range(4)]
    loaded = asynctron.load(f"{root}/four")  # 4 ranks -> one process, plain tensors
    assert torch.equal(loaded["dt"], _full(1)) and loaded["step"] == 4


def test_an_unchanged_structure_skips_the_plan_collectives(
        two_rank_results: tuple[str, list[dict[str, Any]]]) -> None:
    _, results = two_rank_results
    for r in results:
        # start, gather plans, scatter plans, gather reports, broadcast outcome; then the plan
        # is cached on both ranks and only start and finish remain.
        assert r["calls"] == [5, 3, 3] and r["hits"] == 2


def test_saves_in_flight_together_keep_the_ranks_in_step(
        two_rank_results: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = two_rank_results
    assert all(r["overlap"] == ["step_1", "step_2", "step_3", "step_4"] for r in results)
    loaded = asynctron.load(f"{root}/overlap")
    assert loaded["step"] == 4 and torch.equal(loaded["w1"], torch.full((1000,), 4.0))


def test_stock_dcp_and_asynctron_read_each_other_across_ranks(
        two_rank_results: tuple[str, list[dict[str, Any]]]) -> None:
    _, results = two_rank_results
    assert all(r["stock_to_asynctron"] and r["asynctron_to_stock"] for r in results)


def test_a_coordinator_failing_between_collectives_fails_every_rank_at_once(
        two_rank_results: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = two_rank_results
    assert results[0]["tmp_dir"] == ("StorageError", None)
    assert results[1]["tmp_dir"] == ("PeerError", 0)
    assert results[1]["global_plan"] == ("PeerError", 0)
    assert results[0]["global_plan"] == ("ValueError", None)
    assert "key 'w' is a tensor on rank 0 and bytes on rank 1" in results[0]["global_plan_message"]
    assert all(r["coordinator_failures_s"] < 20 for r in results)  # not the 30 s timeout
    assert not os.path.exists(f"{root}/mismatched")
    assert asynctron.load(f"{root}/after_failures")["w"].shape == (3,)


def test_a_rank_failing_mid_write_commits_nothing_and_every_rank_raises(
        two_rank_results: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = two_rank_results
    kind0, rank0, message0 = results[0]["failed"]
    kind1, _, message1 = results[1]["failed"]
    assert kind0 == "PeerError" and rank0 == 1
    assert "found rank 1 failing" in message0 and "ENOSPC" in message0
    assert kind1 == "StorageError" and "ENOSPC" in message1
    assert not os.path.exists(f"{root}/failed")
    assert not [n for n in os.listdir(root) if ".tmp-" in n]


def killed_mid_save(rank: int, world: int, root: str) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        slow = FaultyBackend() if rank == 1 else None
        async with Engine(backend=slow, coordination_timeout_s=60) as engine:
            await engine.save({f"w{rank}": torch.arange(1000.0), "step": 1}, f"{root}/step_1")
            if slow is not None:
                stalled = slow.hold("fsync")  # rank 1's next fsync is held, then the rank dies
            task = engine.save({f"w{rank}": torch.zeros(1000), "step": 2}, f"{root}/step_2")
            if rank == 1:
                await stalled.reached()
                os.kill(os.getpid(), signal.SIGKILL)
            started = asyncio.get_running_loop().time()
            try:
                await task
                return {"error": None}
            except PeerError as error:
                return {"error": str(error), "elapsed_s": asyncio.get_running_loop().time()
                        - started}

    return uvloop.run(run())


def test_a_rank_killed_mid_save_makes_the_others_raise_and_keeps_the_previous_checkpoint(
        tmp_path: object) -> None:
    root = str(tmp_path)
    results = run_local_ranks(killed_mid_save, 2, root, timeout_s=120)
    assert results[1].exitcode == -signal.SIGKILL
    survivor = results[0].unwrap()
    assert survivor["error"] is not None and survivor["elapsed_s"] < 30
    assert not os.path.exists(f"{root}/step_2")
    loaded = asynctron.load(root)  # `latest` still names step_1
    assert loaded["step"] == 1
    assert torch.equal(loaded["w0"], torch.arange(1000.0))
    assert torch.equal(loaded["w1"], torch.arange(1000.0))
