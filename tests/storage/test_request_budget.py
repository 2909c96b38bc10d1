"""RequestBudget: a window of requests in flight, cut when the store throttles, held below the
limit it learned, grown back while the store answers; waiters in arrival order. Its
convergence is checked against a simulated store, deterministically (no clock)."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any

import pytest

from asynctron.storage.backends.objects._request_budget import (
    PROBE_ANSWERS,
    RequestBudget,
    Slot,
)


class Arrivals:
    """Counts tasks that reached `slot()`: a task's first step runs until it holds a place or
    waits for one, so once `reach(n)` returns, n tasks are in flight or queued."""

    def __init__(self) -> None:
        self.count = 0
        self._events: dict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)

    def arrive(self) -> None:
        self.count += 1
        self._events[self.count].set()

    async def reach(self, count: int) -> None:
        await self._events[count].wait()


async def test_no_more_than_the_window_is_in_flight_and_waiters_go_in_order() -> None:
    budget = RequestBudget(3)
    order: list[int] = []
    release = asyncio.Event()
    arrivals = Arrivals()

    async def request(number: int) -> None:
        arrivals.arrive()
        async with budget.slot():
            order.append(number)
            assert budget.in_flight <= budget.window
            await release.wait()

    tasks = [asyncio.create_task(request(n)) for n in range(8)]
    await arrivals.reach(8)
    assert order == [0, 1, 2] and budget.in_flight == 3
    release.set()
    await asyncio.gather(*tasks)
    assert order == list(range(8)) and budget.in_flight == 0
    assert budget.most_in_flight == 3


async def test_a_throttle_cuts_the_window_once_per_burst_and_teaches_the_limit() -> None:
    budget = RequestBudget(16)
    held = [budget.slot() for _ in range(10)]
    slots = [await slot.__aenter__() for slot in held]
    assert [slot.in_flight for slot in slots] == list(range(1, 11))
    assert [slot.filled_window for slot in slots] == [False] * 9 + [False]
    assert budget.throttled(slots[9])  # refused at 10 in flight: the window goes to 7
    assert (budget.window, budget.limit, budget.num_cuts) == (7, 10, 1)
    assert not budget.throttled(slots[8])  # sent at the old size: no second cut
    assert (budget.window, budget.limit, budget.num_cuts) == (7, 9, 1)
    assert budget.throttled(slots[4])  # refused at 5: the window stays below the limit
    assert (budget.window, budget.limit, budget.num_cuts) == (4, 5, 1)
    assert budget.least_window == 4
    for slot in held:
        await slot.__aexit__(None, None, None)
    async with budget.slot() as slot:  # sent after the cut: a new throttle cuts again
        assert budget.throttled(slot)
    assert (budget.window, budget.limit) == (1, 1)  # 1 in flight * 0.7, at least 1
    async with budget.slot() as slot:
        assert not budget.throttled(slot)  # nothing left to cut: the caller backs off
    assert budget.num_cuts == 2


async def test_the_window_holds_below_the_limit_then_probes_it_then_forgets_it() -> None:
    budget = RequestBudget(16)
    held = [budget.slot() for _ in range(5)]
    slots = [await slot.__aenter__() for slot in held]
    budget.throttled(slots[4])  # refused at 5: window 3 (5 * 0.7)
    for slot in held:
        await slot.__aexit__(None, None, None)
    windows = []
    for _ in range(1 + 2 * PROBE_ANSWERS):  # every answer with the window full
        held = [budget.slot() for _ in range(budget.window)]
        slots = [await slot.__aenter__() for slot in held]
        budget.answered(slots[-1])
        windows.append(budget.window)
        for slot in held:
            await slot.__aexit__(None, None, None)
    # one answer back to the plateau (4), `PROBE_ANSWERS` there, `PROBE_ANSWERS` at the limit
    assert windows == [4] * PROBE_ANSWERS + [5] * PROBE_ANSWERS + [6]
    assert budget.limit is None  # the store served 5 in flight: it serves more now


async def test_only_a_full_window_grows() -> None:
    budget = RequestBudget(16)
    held = [budget.slot() for _ in range(8)]
    slots = [await slot.__aenter__() for slot in held]
    budget.throttled(slots[7])  # window 5, limit 8
    for slot in held:
        await slot.__aexit__(None, None, None)
    for _ in range(100):
        async with budget.slot() as slot:  # one request at a time
            budget.answered(slot)
    assert budget.window == 5


@dataclass(kw_only=True)
class Simulation:
    """What a simulated run recorded: for each request sent, whether the store refused it,
    and the requests the store held at each answer."""

    refused: list[bool]
    store_in_flight: list[int]

    def steady(self) -> tuple[float, float]:
        """The share of requests refused in the second half of the sends, and the mean
        requests the store held in the second half of the answers."""
        refused = self.refused[len(self.refused) // 2:]
        held = self.store_in_flight[len(self.store_in_flight) // 2:]
        return sum(refused) / len(refused), sum(held) / len(held)


async def simulate(budget: RequestBudget, *, store_limit: int | None, num_ready: int,
                   num_requests: int, refuse_late: bool) -> Simulation:
    """Drive `budget` as the store's requests do (`StoreRequests`), against a store that serves
    `store_limit` requests in flight (None: any number) and refuses (503) those beyond:
    the caller has `num_ready` requests ready at a time and sends them while the window has
    room; the store answers them one at a time, in the order sent. A refused request is
    sent again: at once into a smaller window, else (the caller backs off) after the next
    answer. `refuse_late`: the 503 comes back in its turn among the answers (a proxy that
    reads the body first) instead of at once (a server that refuses before the body).

    Deterministic: no task and no clock; a slot is taken only while the window has room, so
    entering it never waits."""
    sent: collections.deque[tuple[Any, Slot, bool]] = collections.deque()
    refused: list[bool] = []
    store_in_flight: list[int] = []
    held = to_send = num_answered = num_out = 0
    to_send = num_requests
    while num_answered < num_requests:
        backing_off = False
        while (not backing_off and to_send and num_out < num_ready
               and budget.in_flight < budget.window):
            place = budget.slot()
            slot = await place.__aenter__()
            to_send -= 1
            num_out += 1
            refuse = store_limit is not None and held >= store_limit
            refused.append(refuse)
            held += not refuse
            if refuse and not refuse_late:
                backing_off = not budget.throttled(slot)
                await place.__aexit__(None, None, None)
                to_send += 1
                num_out -= 1
            else:
                sent.append((place, slot, refuse))
        place, slot, refuse = sent.popleft()
        store_in_flight.append(held)
        if refuse:
            budget.throttled(slot)
            to_send += 1
        else:
            held -= 1
            num_answered += 1
            budget.answered(slot)
        num_out -= 1
        await place.__aexit__(None, None, None)
    return Simulation(refused=refused, store_in_flight=store_in_flight)


@pytest.mark.parametrize("refuse_late", [False, True], ids=["refused-at-once", "refused-late"])
@pytest.mark.parametrize(("store_limit", "num_ready"), [(1, 8), (2, 8), (4, 9), (4, 64),
                                                       (16, 64)])
async def test_against_a_store_that_serves_a_fixed_number_the_window_settles_just_below_it(
        store_limit: int, num_ready: int, refuse_late: bool) -> None:
    """At most one request in ten refused once settled, the store kept at least 0.9 full,
    the window at the store's number or probing one past it."""
    budget = RequestBudget(64)
    run = await simulate(budget, store_limit=store_limit, num_ready=num_ready,
                         num_requests=400, refuse_late=refuse_late)
    refused_share, held = run.steady()
    assert refused_share <= 0.1
    assert held >= 0.9 * store_limit
    assert store_limit <= budget.window <= store_limit + 1


async def test_against_a_store_that_never_throttles_the_window_stays_at_the_most() -> None:
    budget = RequestBudget(64)
    run = await simulate(budget, store_limit=None, num_ready=100, num_requests=400,
                         refuse_late=False)
    assert not any(run.refused) and budget.window == 64 and budget.most_in_flight == 64


async def test_once_the_store_stops_throttling_the_window_grows_back_to_the_most() -> None:
    budget = RequestBudget(64)
    await simulate(budget, store_limit=4, num_ready=100, num_requests=200, refuse_late=True)
    assert budget.window <= 5
    run = await simulate(budget, store_limit=None, num_ready=100, num_requests=3000,
                         refuse_late=True)
    assert not any(run.refused) and budget.window == 64 and budget.limit is None


async def test_a_smaller_window_holds_new_requests_until_enough_finish() -> None:
    budget = RequestBudget(4)
    release = asyncio.Event()
    entered = 0
    arrivals = Arrivals()

    async def request(throttle: bool = False) -> None:
        nonlocal entered
        arrivals.arrive()
        async with budget.slot() as slot:
            entered += 1
            if throttle:
                budget.throttled(slot)
                return
            await release.wait()

    holders = [asyncio.create_task(request()) for _ in range(3)]
    await arrivals.reach(3)
    await request(throttle=True)  # 4 in flight: the window goes to 2
    assert budget.window == 2
    late = asyncio.create_task(request())
    await arrivals.reach(5)
    assert entered == 4  # 3 still in flight, the late one waits
    release.set()
    await asyncio.gather(*holders, late)
    assert entered == 5


async def test_a_cancelled_waiter_passes_its_turn_on() -> None:
    budget = RequestBudget(1)
    release = asyncio.Event()
    arrivals = Arrivals()

    async def hold() -> None:
        arrivals.arrive()
        async with budget.slot():
            await release.wait()

    holder = asyncio.create_task(hold())
    await arrivals.reach(1)
    cancelled = asyncio.create_task(hold())
    waiting = asyncio.create_task(hold())
    await arrivals.reach(3)
    assert budget.in_flight == 1  # the holder; the other two wait
    cancelled.cancel()
    release.set()
    await asyncio.gather(holder, waiting)
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert budget.in_flight == 0


def test_the_most_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        RequestBudget(0)
