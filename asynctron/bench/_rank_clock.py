"""A rank's clock in the multi-rank benches: each measurement's time between barriers (so the
slowest rank's time is the round's), and the process's CPU seconds."""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch.distributed as dist


def cpu_s() -> float:
    """This process's CPU time so far (every thread: the loop's, the executor's, a native
    client's), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Clock:
    """Per-measurement times of this rank, each between barriers (so the slowest rank's time
    is the round's), and its CPU seconds."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}
        self.notes: dict[str, Any] = {}

    async def time(self, name: str, work: Callable[[], Awaitable[Any]], *,
                   keep: bool = True) -> Any:
        await asyncio.to_thread(dist.barrier)
        cpu = cpu_s()
        started = time.perf_counter()
        value = await work()
        elapsed = time.perf_counter() - started
        used = cpu_s() - cpu
        await asyncio.to_thread(dist.barrier)
        if keep:
            self.times.setdefault(name, []).append(elapsed)
            self.cpu.setdefault(name, []).append(used)
        return value

    def time_blocking(self, name: str, work: Callable[[], Any], *, keep: bool) -> None:
        """Blocks: `work()` between barriers, its time kept under `name`."""
        dist.barrier()
        started = time.perf_counter()
        work()
        elapsed = time.perf_counter() - started
        dist.barrier()
        if keep:
            self.keep(name, elapsed)

    def keep(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def result(self, **extra: Any) -> dict[str, Any]:
        return {"times": self.times, "cpu": self.cpu, "notes": self.notes, **extra}
