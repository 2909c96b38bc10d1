"""Keeping the loader's workers off busy cores: which CPUs count as busy, and what is left."""

from __future__ import annotations

import os
import threading
import time

from asynctron.datasets.loader import _busy_cores
from asynctron.datasets.loader._busy_cores import busy_cpus, cpus_away_from


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
    """The spinner spins until both readings are taken. A reading of this very process waits
    for the GIL again and again while a thread spins Python on another core (see
    `thread_times`): on the H100's 16 cores the readings outlasted a spinner that stopped at a
    set time, which was then missing from the second (KeyError, 2026-11-26). On a loaded
    2-core machine the spinner may get less than a busy share of a core in a given second
    (the suite on three workers, 2026-12-07), so it is looked at until a window sees it
    spin: it must be seen busy in one."""
    stop, spinning = threading.Event(), threading.Event()

    def spin() -> None:
        spinning.set()
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin)
    thread.start()
    seen = []
    try:
        assert spinning.wait(60)
        for _ in range(30):  # a 1 s window in which the machine gave the spinner its core
            before = _busy_cores.thread_times(os.getpid())
            time.sleep(1.0)  # the window the busy time is measured over
            after = _busy_cores.thread_times(os.getpid())
            seen.append(after[thread.native_id][1] in busy_cpus(before, after, 1.0))
            if seen[-1]:
                break
    finally:
        stop.set()
        thread.join()
    assert seen[-1], f"the spinner was never seen busy in {len(seen)} windows of 1 s"


def test_a_thread_that_ends_during_a_reading_is_left_out(monkeypatch) -> None:
    """A thread listed, then gone before its stat is read (as the H100's spinner, during a
    reading slowed by the GIL), is not in the reading, and raises nothing; the threads still
    alive are."""
    stop = threading.Event()
    ending = threading.Thread(target=stop.wait)
    ending.start()

    class ListThenEnd:
        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        def listdir(self, path: str) -> list[str]:
            names = os.listdir(path)
            stop.set()
            ending.join()
            while os.path.exists(f"/proc/self/task/{ending.native_id}"):  # the kernel's part
                time.sleep(0.001)
            return names

    monkeypatch.setattr(_busy_cores, "os", ListThenEnd())
    times = _busy_cores.thread_times(os.getpid())
    assert ending.native_id not in times and threading.get_native_id() in times


def test_a_thread_named_with_a_parenthesis_is_read_right() -> None:
    """The command in /proc/<pid>/task/<tid>/stat may hold ") " and spaces: the fields are
    counted from its last ")"."""
    cpu = max(os.sched_getaffinity(0))
    named, stop = threading.Event(), threading.Event()

    def run_named() -> None:
        os.sched_setaffinity(0, {cpu})
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write("a) R 1 2 (b")
        named.set()
        stop.wait(5)

    thread = threading.Thread(target=run_named)
    thread.start()
    try:
        assert named.wait(5)
        with open(f"/proc/self/task/{thread.native_id}/stat", "rb") as f:
            assert b"(a) R 1 2 (b) " in f.read()
        assert _busy_cores.thread_times(os.getpid())[thread.native_id][1] == cpu
    finally:
        stop.set()
        thread.join()


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
