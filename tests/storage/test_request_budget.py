"""RequestBudget: a window of requests in flight, cut when the store throttles, grown back
while it answers; waiters in arrival order."""

from __future__ import annotations

import asyncio

import pytest

from asynctron.storage.backends.objects._request_budget import RequestBudget


async def test_no_more_than_the_window_is_in_flight_and_waiters_go_in_order() -> None:
    budget = RequestBudget(3)
    order: list[int] = []
    release = asyncio.Event()

    async def request(number: int) -> None:
        async with budget.slot():
            order.append(number)
            assert budget.in_flight <= budget.window
            await release.wait()

    tasks = [asyncio.create_task(request(n)) for n in range(8)]
    await asyncio.sleep(0.01)
    assert order == [0, 1, 2] and budget.in_flight == 3
    release.set()
    await asyncio.gather(*tasks)
    assert order == list(range(8)) and budget.in_flight == 0
    assert budget.most_in_flight == 3


async def test_a_throttle_cuts_the_window_once_per_burst_and_answers_grow_it_back() -> None:
    budget = RequestBudget(16)
    held = [budget.slot() for _ in range(10)]
    slots = [await slot.__aenter__() for slot in held]
    assert budget.throttled(slots[0])  # 10 in flight: the window goes to 7
    assert budget.window == 7
    assert not any(budget.throttled(slot) for slot in slots[1:])  # sent at the old size
    assert budget.window == 7 and budget.num_cuts == 1
    for slot in held:
        await slot.__aexit__(None, None, None)
    async with budget.slot() as slot:  # sent after the cut: a new throttle cuts again
        assert budget.throttled(slot)
    assert budget.window == 1 and budget.least_window == 1  # 1 in flight * 0.7, at least 1
    async with budget.slot() as slot:
        assert not budget.throttled(slot)  # nothing left to cut: the caller backs off
    for _ in range(200):
        async with budget.slot() as slot:
            budget.answered()
    assert budget.window == 16  # grown back, never past the most


async def test_a_smaller_window_holds_new_requests_until_enough_finish() -> None:
    budget = RequestBudget(4)
    release = asyncio.Event()
    entered = 0

    async def request(throttle: bool = False) -> None:
        nonlocal entered
        async with budget.slot() as slot:
            entered += 1
            if throttle:
                budget.throttled(slot)
                return
            await release.wait()

    holders = [asyncio.create_task(request()) for _ in range(3)]
    await asyncio.sleep(0.01)
    await request(throttle=True)  # 4 in flight: the window goes to 2
    assert budget.window == 2
    late = asyncio.create_task(request())
    await asyncio.sleep(0.01)
    assert entered == 4  # 3 still in flight, the late one waits
    release.set()
    await asyncio.gather(*holders, late)
    assert entered == 5


async def test_a_cancelled_waiter_passes_its_turn_on() -> None:
    budget = RequestBudget(1)
    release = asyncio.Event()

    async def hold() -> None:
        async with budget.slot():
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(hold())
    waiting = asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    cancelled.cancel()
    release.set()
    await asyncio.gather(holder, waiting)
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert budget.in_flight == 0


def test_the_most_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        RequestBudget(0)
