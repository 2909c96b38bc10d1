"""Cancelling a save at each await point: the tmp dir goes, `latest` stays, the budget returns."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from asynctron import Engine
from asynctron.testing import FaultyFileIO

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


@pytest.mark.parametrize("cancel_after", ["request", "first_yield", "staged", "during_fsync"])
async def test_cancel_leaves_no_trace(shm_path: str, cancel_after: str) -> None:
    """Invariant: after a cancelled save, the previous checkpoint is `latest` and loads, no tmp
    dir remains, and the whole memory budget is free."""
    async with Engine(file_io=FaultyFileIO(fsync_delay_s=0.2), **SMALL) as engine:
        await engine.save({"step": 1}, f"{shm_path}/step_1")
        task = engine.save({"w": torch.ones(400_000), "step": 2}, f"{shm_path}/step_2")
        if cancel_after == "first_yield":
            await asyncio.sleep(0)
        elif cancel_after == "staged":
            await task.staged
        elif cancel_after == "during_fsync":
            await task.staged
            await asyncio.sleep(0.1)
        assert task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.budget.borrowed_bytes == 0
        assert (await engine.load(shm_path))["step"] == 1
    assert sorted(os.listdir(shm_path)) == ["latest", "step_1"]


async def test_cancelling_the_awaiter_does_not_cancel_the_save(shm_path: str) -> None:
    """`await task` is shielded: a caller's timeout does not abort the checkpoint."""
    async with Engine(**SMALL) as engine:
        task = engine.save({"w": torch.ones(400_000)}, f"{shm_path}/s")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.ensure_future(_await(task)), timeout=0)
        result = await task
    assert result.nbytes == 1_600_000


async def _await(task: object) -> object:
    return await task  # type: ignore[misc]


async def test_closing_the_engine_waits_for_saves_in_flight(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        task = engine.save({"w": torch.ones(400_000)}, f"{shm_path}/s")
    assert task.done() and (await task).nbytes == 1_600_000
