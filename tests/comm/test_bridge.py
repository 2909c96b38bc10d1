"""Works and torch futures, awaited on the loop: values, errors, the waiting-thread path, and
what a cancelled or orphaned wait leaves behind."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import uvloop

from asynctron.comm import wait_future, wait_work
from asynctron.comm._bridge import peer_error
from asynctron.engine import Engine


class _Watched(torch.futures.Future):
    """A torch future that says when a callback was added to it (the wait is registered)."""

    def __init__(self) -> None:
        super().__init__()
        self.registered = threading.Event()

    def add_done_callback(self, callback: Any) -> None:
        super().add_done_callback(callback)
        self.registered.set()


def _complete_once_waited(future: _Watched, value: Any = None,
                          error: BaseException | None = None) -> threading.Thread:
    """A thread that completes `future` once a wait is registered on it."""
    def complete() -> None:
        assert future.registered.wait(60), "nobody waited on the future"
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    thread = threading.Thread(target=complete)
    thread.start()
    return thread


async def test_a_future_completed_on_another_thread_wakes_the_loop() -> None:
    future = _Watched()
    thread = _complete_once_waited(future, value=7)
    assert await wait_future(future) == 7
    thread.join()


async def test_the_future_error_propagates() -> None:
    future = _Watched()
    thread = _complete_once_waited(future, error=ValueError("backend said no"))
    with pytest.raises(ValueError, match="backend said no"):
        await wait_future(future)
    thread.join()


async def test_a_done_future_returns_at_once() -> None:
    future: torch.futures.Future[str] = torch.futures.Future()
    future.set_result("ready")
    assert await wait_future(future) == "ready"


async def test_cancelling_the_wait_leaves_the_future_alone() -> None:
    """Invariant: a cancelled wait is only a wait; completing the future later raises nothing
    on any thread and reaches nobody."""
    loop = asyncio.get_running_loop()
    problems: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: problems.append(context))
    future = _Watched()
    waiter = asyncio.ensure_future(wait_future(future))
    await asyncio.to_thread(future.registered.wait, 60)  # the wait is registered
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    future.set_result(1)  # runs the callback here, inline
    await asyncio.sleep(0)  # one turn: the loop runs the wake-up that callback queued
    assert problems == [] and future.value() == 1


def test_a_future_completing_after_its_loop_closed_is_harmless() -> None:
    future = _Watched()

    async def wait_then_give_up() -> None:
        waiter = asyncio.ensure_future(wait_future(future))
        await asyncio.to_thread(future.registered.wait, 60)  # the wait is registered
        waiter.cancel()

    uvloop.run(wait_then_give_up())  # closes the loop
    assert future.registered.is_set()
    future.set_result(3)
    assert future.value() == 3


async def test_a_work_without_future_waits_through_the_door(world_one: None) -> None:
    out = torch.empty(4)
    # gloo's reduce-scatter has no future; the list form is in every torch we support
    work = dist.reduce_scatter(out, [torch.arange(4.0)], async_op=True)
    assert work is not None
    with pytest.raises(TypeError, match=r"^work .*: expected a backend with futures or a "
                                        r"run_blocking door, found neither; pass "
                                        r"run_blocking=engine\.run_blocking$"):
        await wait_work(work, run_blocking=None)
    async with Engine(num_workers=1) as engine:
        await wait_work(work, run_blocking=engine.run_blocking)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


async def test_a_work_with_a_future_needs_no_thread(world_one: None) -> None:
    tensor = torch.ones(3)
    work = dist.all_reduce(tensor, async_op=True)
    assert work is not None
    await wait_work(work, run_blocking=None)
    assert tensor.tolist() == [1.0, 1.0, 1.0]


def test_peer_error_names_the_group_and_keeps_the_backend_sentence(world_one: None) -> None:
    cause = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                         "[127.0.0.1]:4242. This is typically caused by a remote worker crashing.")
    error = peer_error("all-reduce of bucket 2", None, cause)
    assert error.rank is None
    assert str(error) == (
        "all-reduce of bucket 2 on ranks [0]: expected every rank to take part, found a rank of "
        "[0] gone or late (Connection closed by peer [127.0.0.1]:4242); stop this rank and "
        "restart the job from its last checkpoint")
