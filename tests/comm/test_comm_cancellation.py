"""Cancelling the comm awaitables: what each leaves behind (a collective cannot be
un-launched). The in-flight cases with a late peer run on real ranks in
tests/distributed/test_comm_ranks.py (`cancelled_synchronize`, `collectives`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asynctron.comm import BucketManager
from asynctron.errors import BusyError


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


async def test_a_cancelled_synchronize_leaves_the_step_open_and_resumable(
        world_one: None) -> None:
    """Invariant: cancelling synchronize() hands nothing out and drops nothing: zero_grad()
    refuses, and the next synchronize() finishes the same step."""
    net = _net()
    manager = BucketManager(net)
    net(torch.randn(4, 8)).sum().backward()
    grads_before = [p.grad.clone() for p in net.parameters()]
    task = asyncio.get_running_loop().create_task(manager.synchronize())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(BusyError, match="await synchronize"):
        manager.zero_grad()
    await manager.synchronize()
    for param, before in zip(net.parameters(), grads_before, strict=True):
        torch.testing.assert_close(param.grad, before)


async def test_a_cancelled_all_reduce_wait_can_be_awaited_again(world_one: None) -> None:
    manager = BucketManager(_net())
    bucket = manager.buckets[0]
    bucket.buffer.fill_(2.0)
    task = bucket.start_all_reduce()
    waiter = asyncio.ensure_future(_await(task))
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await task  # the all-reduce itself went on
    assert task.done() and torch.all(bucket.buffer == 2.0)


async def _await(task: object) -> None:
    await task  # type: ignore[misc]
