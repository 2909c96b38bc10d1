"""Keeping the loader's workers off busy cores: which CPUs count as busy, and what is left."""

from __future__ import annotations

import os
import threading
import time

from asynctron.datasets import _busy_cores
from asynctron.datasets._busy_cores import busy_cpus, cpus_away_from


def test_a_thread_over_half_a_core_marks_its_cpu_busy() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    before = {1: (0, 0), 2: (0, 1), 3: (0, 2)}
    after = {1: (ticks, 0), 2: (ticks // 4, 1), 3: (ticks, 3), 4: (ticks, 5)}
    # thread 3 moved: its CPU now counts; thread 4 is new, with no reading to compare
    assert busy_cpus(before, after, 1.0) == {0, 3}
    assert busy_cpus(before, after, 4.0) == set()  # a quarter of a core over 4 s


def test_busy_cpus_are_left_out_unless_none_would_remain() -> None:
    allowed = frozenset({0, 1, 2})
    assert cpus_away_from({1}, allowed) == {0, 2}
    assert cpus_away_from({7}, allowed) == allowed
    assert cpus_away_from({0, 1, 2}, allowed) == allowed


def test_thread_times_read_this_process_threads() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=lambda: stop.wait(5))
    thread.start()
    try:
        times = _busy_cores.thread_times(os.getpid())
        assert {threading.get_native_id(), thread.native_id} <= set(times)
        assert all(ticks >= 0 and cpu in range(os.cpu_count() or 1)
                   for ticks, cpu in times.values())
    finally:
        stop.set()
        thread.join()
    assert _busy_cores.thread_times(2**22 + 12345) == {}  # no such process


def test_a_spinning_thread_is_seen_busy() -> None:
    def spin() -> None:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pass

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    before = _busy_cores.thread_times(os.getpid())
    time.sleep(1.0)
    after = _busy_cores.thread_times(os.getpid())
    thread.join()
    assert after[thread.native_id][1] in busy_cpus(before, after, 1.0)


def test_a_refused_binding_leaves_the_placement_as_it_was(monkeypatch) -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    avoidance = _busy_cores.BusyCoreAvoidance(os.getpid(), allowed)
    me = threading.get_native_id()
    monkeypatch.setattr(_busy_cores, "thread_times", lambda pid: {me: (10**9, min(allowed))})
    avoidance._last = {me: (0, min(allowed))}
    avoidance._last_at -= _busy_cores.LOOK_EVERY_S

    def refuse(pid: int, cpus: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    avoidance.look()  # no error: the worker goes on writing batches
    assert os.sched_getaffinity(0) == allowed
