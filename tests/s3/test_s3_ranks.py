"""8 real gloo ranks on one S3 store list it once per collective load, keep the job's request
budget, and fail together within the deadline (every store's 2-rank test: tests/objects)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import uvloop

from asynctron import Engine
from asynctron._launch import run_local_ranks
from tests.s3.conftest import keys_under

pytestmark = pytest.mark.slow


def eight_ranks_on_one_store(rank: int, world: int, root: str, endpoint: str,
                             deadline_s: float) -> dict[str, Any]:
    """Every rank saves and loads collectively; rank 5 reaches the store through a proxy that
    breaks its uploads, then stalls, then lets everything through; the others directly."""
    from asynctron.storage import store_operation
    from asynctron.storage.backends.s3 import S3Backend, S3Config
    from asynctron.testing.tcp_proxy import TcpFaultProxy

    host, _, port = endpoint.removeprefix("http://").partition(":")
    out: dict[str, Any] = {}

    async def timed(what: str, work: Any) -> None:
        started = time.monotonic()
        try:
            await work
        except Exception as error:
            out[f"{what}_error"] = f"{type(error).__name__}: {error}"
        out[f"{what}_after_s"] = time.monotonic() - started

    async def run(proxy: TcpFaultProxy) -> None:
        backend = S3Backend(S3Config(endpoint_url=proxy.endpoint if rank == 5 else endpoint,
                                     deadline_s=deadline_s, read_timeout_s=2,
                                     job_max_requests=16))
        state = {f"w{rank}": torch.full((1 << 20,), float(rank)), "step": 0}
        template = {f"w{rank}": torch.zeros(1 << 20)}
        async with Engine(backend=backend, slab_bytes=4 << 20) as engine:
            await engine.save(state, f"{root}/step_0")
            with store_operation("load") as load:
                loaded = await engine.load_into(template, root, collective=True)
            out["lists"] = load.statistics().num_lists
            out["loaded"] = torch.equal(loaded[f"w{rank}"], state[f"w{rank}"])
            if rank == 5:
                proxy.reset_each_after(256 << 10)
            await timed("save", engine.save({**state, "step": 1}, f"{root}/step_1"))
            if rank == 5:
                proxy.stall()
            await timed("load", engine.load_into(template, root, collective=True))
            proxy.pass_through()
            out["previous"] = (await engine.load(root, collective=True))["step"]
            await engine.save({**state, "step": 2}, f"{root}/step_2")
            out["again"] = (await engine.load(root, collective=True))["step"]
            out["most_in_flight"] = backend.client.most_in_flight

    with TcpFaultProxy.start(host, int(port)) as proxy:
        uvloop.run(run(proxy))
    return out


def test_eight_ranks_list_once_per_load_and_fail_together_within_the_deadline(
        s3_root: str, s3_env: Any, s3_objects: Any) -> None:
    """8 ranks, one store: a collective load lists the store once for the whole job, and each
    process keeps its share of the job's request budget in flight. Rank 5's
    connections reset mid-save: rank 5 fails once its store was silent for the deadline, the
    others learn it at the commit; a collective load while rank 5's store stalls fails on
    every rank within the deadline too. Nothing of step_1 is visible, and the same
    engines save and load again."""
    deadline_s = 3.0
    results = [r.unwrap() for r in run_local_ranks(
        eight_ranks_on_one_store, 8, s3_root, s3_env.endpoint, deadline_s, timeout_s=300)]
    assert sum(result["lists"] for result in results) == 1
    assert all(1 <= result["most_in_flight"] <= 16 // 8 for result in results)  # the job's 16
    assert all(result["loaded"] for result in results)
    assert "StorageError" in results[5]["save_error"], results[5]
    assert "step_1/__5_" in results[5]["save_error"]
    assert "StorageError" in results[5]["load_error"], results[5]
    for rank, result in enumerate(results):
        if rank != 5:
            assert "PeerError" in result["save_error"] and "rank 5 failing" in result[
                "save_error"], result
            assert "PeerError" in result["load_error"] and "rank 5 failing" in result[
                "load_error"], result
        for what in ("save", "load"):  # the deadline, its 10%, and the ranks' own turns
            assert result[f"{what}_after_s"] < deadline_s * 1.1 + 2, (rank, result)
        assert result["previous"] == 0 and result["again"] == 2
    names = {key.split("/")[0] for key in keys_under(s3_objects, s3_root)}
    assert names == {"latest", "step_0", "step_2"}
