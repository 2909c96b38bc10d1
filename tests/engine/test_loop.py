"""The loop never blocks during a save, and staging never exceeds its memory budget."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asynctron import Engine
from asynctron.engine import free_idle_staging, staging_statistics
from asynctron.testing import LoopWatchdog


async def test_running_loop_is_uvloop() -> None:
    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


@pytest.mark.slow
async def test_heartbeat_keeps_beating_during_a_save(shm_path: str) -> None:
    """Invariant: a 256 MiB save never stalls the loop for long (bound generous for 2 noisy
    cores; `asynctron bench save` reports the real figure)."""
    state = {f"w{i}": torch.randn(4 << 20) for i in range(16)}  # 16 x 16 MiB
    async with Engine(memory_budget_bytes=128 << 20) as engine, LoopWatchdog() as dog:
        await engine.save(state, f"{shm_path}/big")
    report = dog.report()
    print(f"worst loop delay during a 256 MiB save: {report.worst_delay_s * 1e3:.2f} ms")
    assert report.num_beats > 10
    assert report.worst_delay_s < 0.25


async def test_staging_stays_within_budget_for_a_state_four_times_larger(shm_path: str) -> None:
    budget = 4 << 20
    state = {f"w{i}": torch.randn(1 << 20) for i in range(4)}  # 16 MiB = 4 x budget
    # the process-wide cache starts empty: idle slabs an earlier test's engine left (of
    # another size, up to its larger budget) would leave this engine's slabs no room there
    free_idle_staging()
    before = staging_statistics()
    async with Engine(memory_budget_bytes=budget, slab_bytes=1 << 20) as engine:
        task = engine.save(state, f"{shm_path}/waves")
        await task
        stats = engine.budget.statistics()
    after = staging_statistics()
    assert stats.peak_borrowed_bytes <= budget and stats.borrowed_bytes == 0
    # the memory itself, not just the accounting: never more slabs made than the budget holds
    made = after.num_allocated - before.num_allocated
    reused = after.num_reused - before.num_reused
    assert made + reused >= 1 and made <= budget // (1 << 20)
