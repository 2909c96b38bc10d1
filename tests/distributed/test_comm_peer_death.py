"""A peer that dies (SIGKILL) or stays away makes the other ranks raise `PeerError` within the
timeout, from `synchronize()` and from the object collectives; nobody hangs."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from typing import Any

import pytest
import torch
import uvloop

from asynctron._launch import run_local_ranks
from asynctron.comm import BucketManager, CollectiveGroup, new_gloo_group
from asynctron.engine import Engine
from asynctron.errors import PeerError

TIMEOUT_S = 8.0

pytestmark = pytest.mark.slow


def _step(model: torch.nn.Module, rank: int) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()


def _raised(errors: dict[str, Any], name: str, started_s: float, exc: PeerError) -> None:
    errors[name] = {"message": str(exc), "rank": exc.rank,
                    "timeout": isinstance(exc, TimeoutError),
                    "elapsed_s": time.perf_counter() - started_s}


def killed_rank(rank: int, world: int) -> dict[str, Any]:
    dedicated = new_gloo_group(timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    manager = BucketManager(model, bucket_size_bytes=4000)

    async def run() -> dict[str, Any]:
        errors: dict[str, Any] = {}
        async with Engine(num_workers=1) as engine:
            group = CollectiveGroup(dedicated, run_blocking=engine.run_blocking,
                                    timeout_s=TIMEOUT_S)
            _step(model, rank)  # a healthy step and collective first
            await manager.synchronize()
            manager.zero_grad()
            await group.barrier()
            if rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            started_s = time.perf_counter()
            _step(model, rank)
            try:
                await manager.synchronize()
            except PeerError as exc:
                _raised(errors, "synchronize", started_s, exc)
            for name in ("all_gather_object", "after"):  # the second finds the group broken
                started_s = time.perf_counter()
                try:
                    await group.all_gather_object(rank)
                except PeerError as exc:
                    _raised(errors, name, started_s, exc)
        return errors

    return uvloop.run(run())


def late_rank(rank: int, world: int) -> dict[str, Any]:
    dedicated = new_gloo_group(timeout_s=10 * TIMEOUT_S)  # our own timeout fires first

    async def run() -> dict[str, Any]:
        errors: dict[str, Any] = {}
        async with Engine(num_workers=1) as engine:
            group = CollectiveGroup(dedicated, run_blocking=engine.run_blocking, timeout_s=1.0)
            await group.barrier()
            if rank == 1:  # alive, but never takes part again
                await asyncio.sleep(3.0)
                return errors
            for name in ("gather_object", "barrier"):
                started_s = time.perf_counter()
                try:
                    if name == "gather_object":
                        await group.gather_object("x")
                    else:
                        await group.barrier()
                except PeerError as exc:
                    _raised(errors, name, started_s, exc)
        return errors

    return uvloop.run(run())


def test_a_killed_rank_makes_the_others_raise_peer_error() -> None:
    results = run_local_ranks(killed_rank, 3, timeout_s=90, pg_timeout_s=TIMEOUT_S)
    assert results[2].exitcode == -signal.SIGKILL
    for result in results[:2]:
        errors = result.unwrap()
        assert set(errors) == {"synchronize", "all_gather_object", "after"}, errors
        for name, error in errors.items():
            assert error["rank"] is None  # three ranks: the backend does not say which
            assert error["elapsed_s"] < 2 * TIMEOUT_S, (name, error)  # liveness, generous
        assert re.fullmatch(
            r"all-reduce of bucket 0 \(0\.01 MiB\) on ranks \[0, 1, 2\]: expected every rank "
            r"to take part, found a rank of \[0, 1, 2\] gone or late \([^()]*peer[^()]*\); stop "
            r"this rank and restart the job from its last checkpoint",
            errors["synchronize"]["message"]), errors["synchronize"]["message"]
        assert errors["after"]["message"] == (
            "collective group of 3 ranks: expected a working group for all_gather_object, found "
            "it broken by an earlier failure of all_gather_object (call 2); create a new group "
            "or restart the job")


def test_a_late_rank_times_out_with_its_rank_named() -> None:
    results = run_local_ranks(late_rank, 2, timeout_s=60)
    assert results[1].unwrap() == {}
    errors = results[0].unwrap()
    assert errors["gather_object"]["rank"] == 1
    assert errors["gather_object"]["timeout"]  # a PeerTimeoutError, like every timeout
    assert errors["gather_object"]["message"].startswith(
        "gather_object (call 2) on ranks [0, 1]: expected every rank to take part, found rank 1 "
        "gone or late (not complete within timeout_s=1); ")
    assert errors["gather_object"]["elapsed_s"] < 10  # liveness, generous
    assert errors["barrier"]["rank"] == 1
    assert "found it broken by an earlier failure" in errors["barrier"]["message"]
