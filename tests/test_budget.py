"""ByteBudget: FIFO admission, oversized requests run alone, cancellation borrows nothing."""

from __future__ import annotations

import asyncio

import pytest

from asynctron.engine import BudgetStatistics, ByteBudget
from asynctron.errors import WouldBlock


def test_total_is_validated() -> None:
    with pytest.raises(ValueError, match=r"^total_bytes: expected a positive int, found 0$"):
        ByteBudget(0)
    budget = ByteBudget(10)
    with pytest.raises(ValueError, match=r"found -1$"):
        budget.total_bytes = -1


async def test_waiters_are_served_in_arrival_order() -> None:
    budget = ByteBudget(100)
    await budget.acquire(80)
    order: list[str] = []

    async def want(name: str, nbytes: int) -> None:
        await budget.acquire(nbytes)
        order.append(name)

    async with asyncio.TaskGroup() as group:
        group.create_task(want("big", 50))
        group.create_task(want("small", 10))  # would fit now, but arrived second
        await asyncio.sleep(0)
        assert order == [] and budget.statistics().num_waiting == 2
        budget.release(80)
    assert order == ["big", "small"]
    assert budget.statistics().peak_borrowed_bytes == 80


async def test_oversized_request_runs_alone() -> None:
    budget = ByteBudget(100)
    await budget.acquire(1)
    with pytest.raises(WouldBlock):
        budget.acquire_nowait(500)
    waiter = asyncio.ensure_future(budget.acquire(500))
    await asyncio.sleep(0)
    assert not waiter.done()
    budget.release(1)
    await waiter
    assert budget.borrowed_bytes == 500
    with pytest.raises(WouldBlock):
        budget.acquire_nowait(1)
    budget.release(500)


async def test_cancelled_waiter_borrows_nothing_and_unblocks_the_next() -> None:
    budget = ByteBudget(100)
    await budget.acquire(100)
    first = asyncio.ensure_future(budget.acquire(100))
    second = asyncio.ensure_future(budget.acquire(0))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await second
    assert budget.borrowed_bytes == 100
    assert "100/100 bytes borrowed" in repr(budget)


async def test_a_waiter_cancelled_just_before_a_release_raises_cancelled() -> None:
    """Invariant: cancellation, not ValueError, even when `release` wakes the queue between the
    waiter's cancellation and the waiter resuming (the cancelled entry is dropped then)."""
    budget = ByteBudget(10)
    budget.acquire_nowait(10)
    waiter = asyncio.ensure_future(budget.acquire(5))
    await asyncio.sleep(0)
    waiter.cancel()
    budget.release(10)  # `_wake` pops the cancelled entry before the waiter runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.statistics() == BudgetStatistics(10, 0, 10, 0)


def test_releasing_more_than_borrowed_is_refused_and_changes_nothing() -> None:
    budget = ByteBudget(100)
    budget.acquire_nowait(40)
    for wrong in (41, -1):
        with pytest.raises(ValueError, match=f"releasing {wrong} bytes, but 40 are borrowed"):
            budget.release(wrong)
    assert budget.borrowed_bytes == 40
