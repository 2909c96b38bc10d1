"""Cancelling and closing the loader at its await points: no batch is lost, no worker, task
or budget is left."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

from asynctron import Engine
from asynctron.datasets import AsyncLoader, GPTDataset
from asynctron.engine import ByteBudget
from asynctron.errors import ClosedError


def _alive(pid: int | None) -> bool:
    assert pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _cancel_a_waiting_next(loader: AsyncLoader,
                                 reading: Callable[[], Awaitable[object]]) -> None:
    """Cancel an `__anext__` once `reading()` says its batch is being read (so the call has
    asked for it and waits), then check nothing was consumed."""
    waiting = asyncio.ensure_future(loader.__anext__())
    await reading()
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert loader.consumed_samples == 0


async def _set_in_a_worker(event: Any) -> None:
    """Wait (off the loop) until a worker sets the (fork context's) `event`."""
    assert await asyncio.to_thread(event.wait, 60), "no worker set the event within 60 s"


class _HeldAtSampleZero(GPTDataset):
    """Holds sample 0 in the (forked) worker until the test sets `release`, having set
    `reached`, so that the first `__anext__` is surely waiting when it is cancelled."""

    reached: Any
    release: Any

    def locate_batch(self, ids: Any) -> Any:
        if 0 in list(ids):
            self.reached.set()
            assert self.release.wait(60), "the test never released sample 0"
        return super().locate_batch(ids)


async def test_a_cancelled_next_loses_no_batch_from_workers(gpt) -> None:
    """Invariant: the batch a cancelled `__anext__` would have returned comes next."""
    held = _HeldAtSampleZero(gpt.dataset, gpt.dataset_path, gpt.indices, gpt.num_samples,
                             gpt.index_split, gpt.config)
    fork = multiprocessing.get_context("fork")
    held.reached, held.release = fork.Event(), fork.Event()
    async with Engine(num_workers=2) as engine, AsyncLoader(
            held, micro_batch_size=2, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 20, num_ready_batches=1, start_method="fork") as loader:
        await _cancel_a_waiting_next(loader, lambda: _set_in_a_worker(held.reached))
        held.release.set()
        first = await loader.__anext__()
    assert torch.equal(first["tokens"], torch.stack([gpt[0]["tokens"], gpt[1]["tokens"]]))


async def test_a_cancelled_next_loses_no_batch_read_in_process(gpt) -> None:
    """Invariant: as above, for batches read in this process (no workers)."""
    reading, gate = asyncio.Event(), asyncio.Event()

    async with Engine(num_workers=2) as engine:
        async def gated_run_blocking(fn, *args):
            reading.set()
            await gate.wait()
            return await engine.run_blocking(fn, *args)

        async with AsyncLoader(gpt, micro_batch_size=2, run_blocking=gated_run_blocking,
                               prefetch_budget=1 << 20, num_ready_batches=1,
                               num_workers=0) as loader:
            await _cancel_a_waiting_next(loader, reading.wait)
            gate.set()
            first = await loader.__anext__()
    assert torch.equal(first["tokens"], torch.stack([gpt[0]["tokens"], gpt[1]["tokens"]]))


class _Counted(GPTDataset):
    """Releases `located` once per batch a (forked) worker has located."""

    located: Any

    def locate_batch(self, ids: Any) -> Any:
        found = super().locate_batch(ids)
        self.located.release()
        return found


@pytest.mark.parametrize("budget_bytes", [1 << 20, 64 << 10])
async def test_aclose_mid_epoch_returns_the_budget_and_stops_the_workers(
        gpt, budget_bytes: int) -> None:
    """Invariant: after aclose nothing is borrowed or waiting and every worker has exited,
    also when the budget was spent (the small one lends pages for 3 batches only) and the
    workers have run ahead: aclose comes once they have located every batch asked for."""
    counted = _Counted(gpt.dataset, gpt.dataset_path, gpt.indices, gpt.num_samples,
                       gpt.index_split, gpt.config)
    counted.located = multiprocessing.get_context("fork").Semaphore(0)
    budget = ByteBudget(budget_bytes)
    async with Engine(num_workers=2) as engine:
        loader = AsyncLoader(counted, micro_batch_size=2, run_blocking=engine.run_blocking,
                             prefetch_budget=budget, num_ready_batches=2, start_method="fork")
        async with loader:
            kept = await loader.__anext__()  # batch 0; batches 1 and 2 asked for
            for _ in range(3):
                assert await asyncio.to_thread(counted.located.acquire, True, 60)
        assert not any(_alive(pid) for pid in loader.worker_pids)
        with pytest.raises(ClosedError, match=r"^loader: closed; create a new AsyncLoader$"):
            await loader.__anext__()
    assert budget.statistics().borrowed_bytes == 0
    assert budget.statistics().num_waiting == 0
    expected = torch.stack([gpt[0]["tokens"], gpt[1]["tokens"]])
    assert torch.equal(kept["tokens"], expected)  # a batch outlives its loader


async def test_cancelling_the_consumer_task_inside_async_with(gpt) -> None:
    """Invariant: cancelling a task that iterates leaves no borrowed bytes or workers."""
    budget = ByteBudget(1 << 20)
    pids: list[int | None] = []
    async with Engine(num_workers=2) as engine:
        started = asyncio.Event()

        async def consume() -> None:
            async with AsyncLoader(gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
                                   prefetch_budget=budget, num_ready_batches=1) as loader:
                pids.extend(loader.worker_pids)
                async for _ in loader:
                    started.set()
                    await asyncio.sleep(3600)

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert budget.statistics().borrowed_bytes == 0 and budget.statistics().num_waiting == 0
    assert pids and not any(_alive(pid) for pid in pids)
