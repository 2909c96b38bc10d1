"""Keeping the loader's worker processes off the cores where the trainer's busy threads run.

A worker the loop wakes is placed by the scheduler, and on a small machine it lands, now and
then, on the core a trainer thread is about to get back to (while that thread waits for the
GIL the core looks idle). On a 2-core VM beside a thread spinning Python, that cost the thread
20% of its work; binding the workers to the other core brought it back (`docs/datasets.md`).
Which thread is the trainer's is not the loader's to know, so each worker looks: four times
a second it reads its parent's threads' CPU time (`/proc/<pid>/task/*/stat`, in the worker, so
the trainer's process pays nothing; ~1.2 ms a look for 100 threads) and keeps itself off the
CPUs of the threads that used more than half a core since the last look. A thread that moves
is followed at the next look.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

#: a thread that used more than this share of a core over the last look is busy
BUSY_SHARE = 0.5
#: seconds between looks (a run's first second counts too: a trainer is found within this)
LOOK_EVERY_S = 0.25

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
#: more than a thread's stat line (52 fields, the command at most 15 bytes of them)
_STAT_BYTES = 4096

# (utime + stime in clock ticks, the CPU it last ran on), per thread id
ThreadTimes = dict[int, tuple[int, int]]


def thread_times(pid: int) -> ThreadTimes:
    """CPU time and last CPU of each thread of `pid` (threads that exit meanwhile are
    skipped; a process that is gone has none).

    Three system calls a thread (`open()` and a buffered read made nine), each of which lets
    go of the GIL. Called in a process where another thread spins Python on another core,
    taking the GIL back can cost a switch interval (5 ms) each time: a reading of 100 threads
    can then last over a second, and threads that end meanwhile are not in it. A worker reads
    its parent, another process, so the trainer's GIL never slows its readings.
    """
    times: ThreadTimes = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return times
    for tid in tids:
        try:
            fd = os.open(f"/proc/{pid}/task/{tid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            stat = os.read(fd, _STAT_BYTES)
        except OSError:
            continue
        finally:
            os.close(fd)
        # after the command's last ")" (the command may hold ") " itself): state is field 3,
        # utime 14, stime 15, processor 39
        fields = stat.rpartition(b")")[2].split()
        times[int(tid)] = (int(fields[11]) + int(fields[12]), int(fields[36]))
    return times


def busy_cpus(before: ThreadTimes, after: ThreadTimes, seconds: float) -> set[int]:
    """The CPUs of the threads that used more than `BUSY_SHARE` of a core between the two
    readings, `seconds` apart."""
    budget = BUSY_SHARE * seconds * _TICKS_PER_S
    return {cpu for tid, (ticks, cpu) in after.items()
            if tid in before and ticks - before[tid][0] > budget}


def cpus_away_from(busy: Iterable[int], allowed: frozenset[int]) -> frozenset[int]:
    """`allowed` without the `busy` CPUs; all of `allowed` where that leaves none."""
    free = allowed - set(busy)
    return free or allowed


class BusyCoreAvoidance:
    """Called by a worker between batches: keeps this process off the CPUs where `parent`'s
    busy threads run, within `allowed`, looking every `LOOK_EVERY_S`."""

    def __init__(self, parent: int, allowed: frozenset[int]) -> None:
        self.parent = parent
        self.allowed = allowed
        self._last = thread_times(parent)
        self._last_at = time.monotonic()
        self._cpus = allowed

    def look(self) -> None:
        """Re-bind this process if the busy threads moved (cheap when no look is due); a
        binding the kernel refuses leaves the placement as it was."""
        now = time.monotonic()
        if now - self._last_at < LOOK_EVERY_S:
            return
        times = thread_times(self.parent)
        cpus = cpus_away_from(busy_cpus(self._last, times, now - self._last_at), self.allowed)
        self._last, self._last_at = times, now
        if cpus != self._cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:  # e.g. the cpuset shrank since the loader started: placement
                return       # is an optimisation, never a reason to fail a batch
            self._cpus = cpus
