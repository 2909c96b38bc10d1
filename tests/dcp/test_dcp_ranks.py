"""The plugins across real gloo ranks (4, 2, then 1): stock DCP reads what
`asynctron.dcp.StorageWriter` writes and the plugin reads what stock DCP writes, bit-exactly,
DTensor shards resharded 4 → 2 → 1 (row and column splits, so ranks read parts of chunks);
`dcp.async_save` with the writer and with the stager (DTensor shards staged); a rank failing
mid-save leaves no checkpoint on any rank and its tmp dir is removed.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from asynctron._launch import run_local_ranks
from asynctron.dcp import AsyncStager, StorageReader, StorageWriter
from asynctron.testing import FaultyBackend

pytestmark = pytest.mark.slow


def _full() -> torch.Tensor:
    return torch.randn(24, 10, generator=torch.Generator().manual_seed(1))


def _wide() -> torch.Tensor:
    return torch.arange(8 * 2048, dtype=torch.float32).reshape(8, 2048)


def _shared() -> dict[str, torch.Tensor]:
    """Tensors every rank holds identically (written once, by one rank)."""
    return {f"layer{i}": torch.full((64, 16), float(i)) for i in range(3)}


def _state(mesh: Any, dt: Any, wide: Any) -> dict[str, Any]:
    return {"dt": distribute_tensor(_full(), mesh, [dt]),
            "wide": distribute_tensor(_wide(), mesh, [wide]),
            "shared": _shared(), "step": 4, "tag": ["x", 1]}


def _target(mesh: Any, dt: Any, wide: Any) -> dict[str, Any]:
    return {"dt": distribute_tensor(torch.zeros(24, 10), mesh, [dt]),
            "wide": distribute_tensor(torch.zeros(8, 2048), mesh, [wide]),
            "shared": {k: torch.zeros_like(v) for k, v in _shared().items()},
            "step": 0, "tag": None}


def _exact(loaded: dict[str, Any]) -> bool:
    """Whether a loaded state (DTensors of any placement) holds the saved values, bit-exactly."""
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v)
            for k, v in loaded.items() if k in ("dt", "wide")}
    return (torch.equal(full["dt"], _full()) and torch.equal(full["wide"], _wide())
            and all(torch.equal(loaded["shared"][k], v) for k, v in _shared().items())
            and loaded["step"] == 4 and loaded["tag"] == ["x", 1])


def _load(reader: Any, mesh: Any, dt: Any, wide: Any) -> bool:
    target = _target(mesh, dt, wide)
    dcp.load(target, storage_reader=reader)
    return _exact(target)


def four_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh, Shard(0), Shard(1))
    out: dict[str, Any] = {}
    dcp.save(state, storage_writer=StorageWriter(f"{root}/four"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/four_stock"))
    out["stock_reads_plugin"] = _load(dcp.FileSystemReader(f"{root}/four"), mesh, Shard(0),
                                      Shard(1))
    out["plugin_reads_stock"] = _load(StorageReader(f"{root}/four_stock"), mesh, Shard(0),
                                      Shard(1))
    out["plugin_reads_plugin"] = _load(StorageReader(f"{root}/four"), mesh, Shard(0), Shard(1))
    dcp.async_save(state, storage_writer=StorageWriter(f"{root}/four_async")).result()
    out["async"] = _load(dcp.FileSystemReader(f"{root}/four_async"), mesh, Shard(0), Shard(1))
    # Rank 1 runs out of space: every rank raises, nothing appears at the path.
    faulty = FaultyBackend(enospc_after_bytes=0) if rank == 1 else None
    writer = StorageWriter(f"{root}/four_fail", backend=faulty)
    try:
        dcp.save(state, storage_writer=writer)
        out["failed"] = None
    except CheckpointException as error:
        out["failed"] = sorted(error.failures)
    writer.close()
    dist.barrier()
    out["files"] = sorted(os.listdir(root))
    return out


def two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    # 4 → 2, the other split: columns of row chunks, rows of column chunks.
    out["reshard_plugin"] = _load(StorageReader(f"{root}/four"), mesh, Shard(1), Shard(0))
    out["reshard_stock"] = _load(StorageReader(f"{root}/four_stock"), mesh, Shard(1), Shard(0))
    state = _state(mesh, Shard(1), Shard(0))
    future = dcp.async_save(state, storage_writer=StorageWriter(f"{root}/two"),
                            async_stager=AsyncStager(memory_budget_bytes=64 << 20))
    future.result()
    out["two_stock_reads"] = _load(dcp.FileSystemReader(f"{root}/two"), mesh, Shard(0),
                                   Shard(1))
    return out


def one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    return {name: _load(StorageReader(f"{root}/{name}"), mesh, Shard(0), Shard(0))
            for name in ("four", "four_stock", "two")} | {
        "one_saved": _save_and_load_one(f"{root}/one", mesh)}


def _save_and_load_one(path: str, mesh: Any) -> bool:
    dcp.save(_state(mesh, Shard(0), Shard(0)), storage_writer=StorageWriter(path))
    return _load(dcp.FileSystemReader(path), mesh, Shard(0), Shard(0))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Any]]:
    root = str(tmp_path_factory.mktemp("ranks"))
    results = {}
    for world, target in ((4, four_ranks), (2, two_ranks), (1, one_rank)):
        results[world] = [r.unwrap() for r in run_local_ranks(target, world, root,
                                                               timeout_s=240)]
    return results


def test_four_ranks_round_trip_both_ways_bit_exactly(runs: dict[int, list[Any]]) -> None:
    for out in runs[4]:
        assert out["stock_reads_plugin"] and out["plugin_reads_stock"]
        assert out["plugin_reads_plugin"] and out["async"]


def test_a_rank_failing_mid_save_leaves_no_checkpoint(runs: dict[int, list[Any]]) -> None:
    for out in runs[4]:
        assert out["failed"] is not None and 1 in out["failed"]
        assert "four_fail" not in out["files"]
        assert not any(".tmp-" in name for name in out["files"])


def test_two_ranks_reshard_and_async_save_with_the_stager(runs: dict[int, list[Any]]) -> None:
    for out in runs[2]:
        assert out == {"reshard_plugin": True, "reshard_stock": True, "two_stock_reads": True}


def test_one_rank_reads_every_checkpoint_whole(runs: dict[int, list[Any]]) -> None:
    assert runs[1] == [{"four": True, "four_stock": True, "two": True, "one_saved": True}]


def cached_plans(rank: int, world: int, root: str) -> list[bool]:
    """Three saves (to a path each) with DCP's plan caching, as Megatron-Core's planner does:
    the later saves get the first one's cached plans. Each loads back bit-exactly."""
    mesh = init_device_mesh("cpu", (world,))
    loaded = []
    for step in range(3):
        path = f"{root}/cached_{world}_{step}"
        dcp.save(_state(mesh, Shard(0), Shard(1)), storage_writer=StorageWriter(path),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        loaded.append(_load(dcp.FileSystemReader(path), mesh, Shard(1), Shard(0)))
    return loaded


@pytest.mark.parametrize("world", [1, 2])
def test_plan_caching_saves_every_time(tmp_path: Any, world: int) -> None:
    """With `DefaultSavePlanner(enable_plan_caching=True)` every save after the first got the
    first save's plans, which named its tmp dir: they failed (ENOENT/EEXIST)."""
    out = [r.unwrap() for r in run_local_ranks(cached_plans, world, str(tmp_path),
                                               timeout_s=240)]
    assert out == [[True, True, True]] * world
    assert sorted(os.listdir(tmp_path)) == [f"cached_{world}_{step}" for step in range(3)]
