"""Two real gloo ranks on s3://: each rank uploads its own objects and the coordinator commits;
DTensor shards reshard on load through ranged reads of the parts each rank needs."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import uvloop
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from asynctron import Engine
from asynctron._launch import run_local_ranks
from tests.s3.conftest import keys_under

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


def test_ranks_upload_their_own_objects_and_reshard_on_load(s3_root: str,
                                                             s3_objects: Any) -> None:
    results = [r.unwrap() for r in run_local_ranks(save_and_reshard, 2, s3_root,
                                                    timeout_s=240)]
    assert all(f.startswith("__0_") for f in results[0]["files"])
    assert all(f.startswith("__1_") for f in results[1]["files"])
    for result in results:
        assert result["rows"] and result["cols"] and result["replicated"]
    keys = keys_under(s3_objects, s3_root)
    assert {key.split("/")[0] for key in keys} == {"latest", "step_9"}
    assert "step_9/manifest.json" in keys


def one_rank_loses_the_store(rank: int, world: int, root: str, endpoint: str,
                             deadline_s: float) -> dict[str, Any]:
    """Rank 1 reaches the store through a proxy that breaks every upload; rank 0 directly."""
    from asynctron.storage.backends.s3 import S3Backend, S3Config
    from asynctron.testing.tcp_proxy import TcpFaultProxy

    host, _, port = endpoint.removeprefix("http://").partition(":")
    out: dict[str, Any] = {}

    async def run(proxy: TcpFaultProxy) -> None:
        backend = S3Backend(S3Config(endpoint_url=proxy.endpoint if rank else endpoint,
                                     deadline_s=deadline_s, read_timeout_s=2))
        state = {f"w{rank}": torch.full((4 << 20,), float(rank)), "step": 0}
        async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
            await engine.save(state, f"{root}/step_0")
            if rank == 1:
                proxy.reset_each_after(1 << 20)
            started = time.monotonic()
            try:
                await engine.save(state, f"{root}/step_1")
            except Exception as error:
                out["error"] = f"{type(error).__name__}: {error}"
            out["failed_after_s"] = time.monotonic() - started
            proxy.pass_through()
            out["previous"] = (await engine.load(root))["step"]
            await engine.save({**state, "step": 2}, f"{root}/step_2")
            out["again"] = (await engine.load(root))["step"]

    with TcpFaultProxy.start(host, int(port)) as proxy:
        uvloop.run(run(proxy))
    return out


def test_one_ranks_store_failure_fails_every_rank_within_the_deadline(
        s3_root: str, s3_env: Any, s3_objects: Any) -> None:
    """Rank 1's connections reset mid-save: rank 1 fails once its store was silent for the
    deadline, rank 0 learns it at the commit (nobody waits for a clean-up or a watchdog);
    nothing of step_1 is visible, and the same engines save again."""
    deadline_s = 3.0
    results = [r.unwrap() for r in run_local_ranks(
        one_rank_loses_the_store, 2, s3_root, s3_env.endpoint, deadline_s, timeout_s=240)]
    assert "StorageError" in results[1]["error"] and "step_1/__1_" in results[1]["error"]
    assert "PeerError" in results[0]["error"] and "rank 1 failing" in results[0]["error"]
    for result in results:
        assert result["failed_after_s"] < deadline_s + 4, results
        assert result["previous"] == 0 and result["again"] == 2
    names = {key.split("/")[0] for key in keys_under(s3_objects, s3_root)}
    assert names == {"latest", "step_0", "step_2"}
