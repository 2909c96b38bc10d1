"""Paced wake-ups: while another thread holds the GIL, a waiting consumer wakes once every
`PACE_INTERVALS` switch intervals (for every batch ready by then) instead of at the first batch,
and gets the same batches."""

from __future__ import annotations

import sys
import threading

import torch

from asynctron import Engine
from asynctron.datasets import AsyncLoader, collate
from asynctron.datasets.loader._wake_pacing import LATE_SHARE, PACE_INTERVALS, WakePacing


def test_a_wake_up_a_switch_interval_late_says_the_gil_was_held() -> None:
    pacing = WakePacing()
    interval = sys.getswitchinterval()
    assert not pacing.contended
    pacing.woke(interval)
    assert pacing.contended
    for late_share in (0.0, LATE_SHARE / 2, 0.49):  # early or prompt: not contention
        pacing.woke(interval)
        pacing.woke(late_share * interval)
        assert not pacing.contended
    assert pacing.interval_s == PACE_INTERVALS * interval


class _AlwaysContended(WakePacing):
    def __init__(self) -> None:
        super().__init__()
        self.contended = True
        self.timer_wakes = 0

    def woke(self, late_s: float) -> None:
        self.timer_wakes += 1


async def test_paced_waits_give_every_batch_in_order(gpt) -> None:
    async with Engine(num_workers=1) as engine, AsyncLoader(
            gpt, micro_batch_size=2, run_blocking=engine.run_blocking, prefetch_budget=1 << 16,
            num_ready_batches=3) as loader:
        pacing = loader._workers.pacing = _AlwaysContended()
        batches = [batch async for batch in loader]
    assert pacing.timer_wakes >= 1  # the first batch cannot be ready when it is asked for
    assert len(batches) == len(gpt) // 2
    for step, batch in enumerate(batches):
        expected = collate([gpt[i] for i in (2 * step, 2 * step + 1)])
        assert all(torch.equal(batch[k], expected[k]) for k in expected)


async def test_beside_a_thread_spinning_python_the_wake_ups_are_paced(gpt) -> None:
    """The loop gets the GIL from a thread that never gives it up only by waiting out the
    switch interval, so its wake-ups come late, and the loader sees it."""
    stop = threading.Event()
    seen = []

    def spin() -> None:
        while not stop.is_set():
            sum(range(10_000))

    async with Engine(num_workers=1) as engine, AsyncLoader(
            gpt, micro_batch_size=2, run_blocking=engine.run_blocking, prefetch_budget=1 << 16,
            num_ready_batches=2) as loader:
        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
        try:
            async for _ in loader:
                seen.append(loader._workers.pacing.contended)
        finally:
            stop.set()
            thread.join()
    assert len(seen) == len(gpt) // 2
    assert any(seen), "no wake-up came a switch interval late beside a GIL-busy thread"
