"""Waking the consumer less often while another thread holds the GIL.

A loop that wakes for a batch needs the GIL. Beside a thread running pure Python (a GPU
trainer's dispatch thread between torch calls), it gets it only by waiting out the switch
interval and making that thread drop it, and every such switch costs the thread: ~1 ms of its
work on the 2-core VM, whatever the loop then does (`docs/datasets.md`). Such wake-ups come a
switch interval late, which is how they are told apart; while they do, a consumer waiting for
a batch wakes once every `PACE_INTERVALS` switch intervals, for every batch ready by then,
instead of at the first one.
"""

from __future__ import annotations

import asyncio
import sys
import time

#: a wake-up this share of a switch interval late waited for another thread's GIL
LATE_SHARE = 0.5
#: while contended, a waiting consumer wakes once this many switch intervals: beside a thread
#: spinning Python, 2 (~60 wake-ups a second with the wait for the GIL) kept it 95-97% of its
#: work cold, against 94-96% with 1 (~90), for a third fewer batches per second
PACE_INTERVALS = 2


class WakePacing:
    """Whether the loop's wake-ups wait for the GIL, from how late the last one came."""

    def __init__(self) -> None:
        self.contended = False

    def woke(self, late_s: float) -> None:
        """A wake-up came `late_s` seconds after its cause (a record written, a timer due)."""
        self.contended = late_s >= LATE_SHARE * sys.getswitchinterval()

    @property
    def interval_s(self) -> float:
        """How long a waiting consumer sleeps while contended."""
        return PACE_INTERVALS * sys.getswitchinterval()

    async def sleep(self) -> None:
        """Sleep `interval_s`, noting how late the wake-up came (on time: the GIL is free
        again)."""
        interval = self.interval_s
        due = time.monotonic() + interval
        await asyncio.sleep(interval)
        self.woke(time.monotonic() - due)
