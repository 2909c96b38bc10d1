"""`LoopWatchdog`: the heartbeat's worst delay, with and without `excluding()` blocks."""

from __future__ import annotations

import asyncio
import time

from asynctron.testing import LoopWatchdog

BLOCK_S = 0.3


async def test_a_blocking_call_is_the_worst_delay_unless_excluded() -> None:
    """A call that holds the loop for BLOCK_S makes a beat that late; the same call inside
    `excluding()` is left out of the delays and counted in `excluded_s`."""
    async with LoopWatchdog() as plain:
        await asyncio.sleep(0.01)  # the heartbeat is sleeping when the loop is taken
        time.sleep(BLOCK_S)
        await asyncio.sleep(0.01)
    async with LoopWatchdog() as dog:
        await asyncio.sleep(0.01)
        with dog.excluding():
            time.sleep(BLOCK_S)
        await asyncio.sleep(0.01)
    assert plain.report().worst_delay_s >= BLOCK_S * 0.9, plain.report()
    assert plain.report().excluded_s == 0.0
    report = dog.report()
    assert report.excluded_s >= BLOCK_S, report
    assert report.worst_delay_s < BLOCK_S, report  # what is left: the loop's own lateness
