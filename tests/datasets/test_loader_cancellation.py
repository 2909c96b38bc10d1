"""Cancelling the loader at its await points: no batch is lost, no task or budget is left."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asynctron import Engine
from asynctron.datasets import AsyncLoader
from asynctron.engine import ByteBudget
from asynctron.errors import ClosedError


async def test_a_cancelled_next_loses_no_batch(gpt) -> None:
    """Invariant: the batch a cancelled `__anext__` would have returned comes next."""
    gate = asyncio.Event()

    async with Engine(num_workers=2) as engine:
        async def slow_run_blocking(fn, *args):
            await gate.wait()
            return await engine.run_blocking(fn, *args)

        async with AsyncLoader(gpt, micro_batch_size=2, run_blocking=slow_run_blocking,
                               prefetch_budget=1 << 20, num_ready_batches=1) as loader:
            waiting = asyncio.ensure_future(loader.__anext__())
            await asyncio.sleep(0)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert loader.consumed_samples == 0
            gate.set()
            first = await loader.__anext__()
            expected = torch.stack([gpt[0]["tokens"], gpt[1]["tokens"]])
            assert torch.equal(first["tokens"], expected)


@pytest.mark.parametrize(("budget_bytes", "rounds"), [(1 << 20, 1), (64 << 10, 20)])
async def test_aclose_mid_epoch_returns_the_budget_and_ends_the_tasks(
        gpt, budget_bytes: int, rounds: int) -> None:
    """Invariant: after aclose nothing is borrowed or waiting and the producer task is
    finished, also when prefetch was waiting for a spent budget with the ready queue full
    (the small budget; repeated, as it depends on timing)."""
    for _ in range(rounds):
        budget = ByteBudget(budget_bytes)
        async with Engine(num_workers=2) as engine:
            loader = AsyncLoader(gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
                                 prefetch_budget=budget, num_ready_batches=2)
            async with loader:
                await loader.__anext__()
                await asyncio.sleep(0.005)  # let prefetch run ahead and borrow
            assert loader._producer is not None and loader._producer.done()
            with pytest.raises(ClosedError, match=r"^loader: closed; create a new AsyncLoader$"):
                await loader.__anext__()
        assert budget.statistics().borrowed_bytes == 0
        assert budget.statistics().num_waiting == 0


async def test_cancelling_the_consumer_task_inside_async_with(gpt) -> None:
    """Invariant: cancelling a task that iterates leaves no borrowed bytes behind."""
    budget = ByteBudget(1 << 20)
    async with Engine(num_workers=2) as engine:
        started = asyncio.Event()

        async def consume() -> None:
            async with AsyncLoader(gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
                                   prefetch_budget=budget, num_ready_batches=1) as loader:
                async for _ in loader:
                    started.set()
                    await asyncio.sleep(3600)

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert budget.statistics().borrowed_bytes == 0 and budget.statistics().num_waiting == 0
