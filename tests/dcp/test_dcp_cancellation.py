"""`dcp.save` and `dcp.load` through asynctron's plugins, cancelled at each stage.

DCP drives its storage plugins synchronously, on the trainer's thread: there is no asyncio
task of the caller's to cancel, and `dcp.async_save`'s future cannot be cancelled once its
thread runs. What cancels a DCP save or load is an interrupt of that thread: Ctrl-C's
KeyboardInterrupt (or the SystemExit a SIGTERM handler raises), which DCP catches on each
rank and raises as its `CheckpointException`. So each test holds the backend at one stage
(a gate: never a sleep), interrupts the main thread there, and checks what the interrupt
leaves: the previous checkpoint loads bit-exactly, nothing half made is at the target path,
no area, lease or open file is left (once the interrupted writer is closed, as a failed
save's is), nothing hangs on the runtime's loop, and the next save or load succeeds.

A plugin waits on the runtime's loop in two ways: `Runtime.call` (the area being made, the
checkpoint being opened, the commit), which an interrupt ends at once while the job goes
on; and a torch future (`write_data`, `read_data`), whose wait takes the interrupt only
when it returns: an interrupt during the writes (reads) takes effect once they end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asynctron.dcp import StorageReader, StorageWriter
from asynctron.testing import FaultyBackend, Gate
from tests.conftest import assert_same, interrupted_once_reached


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(500, 100, generator=g), "b": torch.randn(100, generator=g)},
            "step": seed}


def _zeros() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(500, 100), "b": torch.zeros(100)}, "step": -1}


def _load(path: str, backend: FaultyBackend) -> dict[str, Any]:
    target = _zeros()
    dcp.load(target, storage_reader=StorageReader(path, backend=backend))
    return target


def _open_files_under(root: Any) -> list[str]:
    """What this process holds open under `root` (data files, leases' directory locks)."""
    root = os.path.realpath(root)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(root + "/"):
                found.append(target)
    return sorted(found)


@contextlib.contextmanager
def _interrupted_as_it_returns(gate: Gate) -> Iterator[None]:
    """Ctrl-C for the block's main thread, sent once `gate` is reached, then the gate
    released: for a wait that runs signal handlers only when it returns (a torch future's
    `wait`), the KeyboardInterrupt comes as the held operations end. Fails the test if no
    interrupt was raised."""
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread().ident == main
    interrupted = threading.Event()

    def interrupt_then_release() -> None:
        if gate.wait_reached(timeout_s=120):  # a guard, not a timing
            signal.pthread_kill(main, signal.SIGUSR1)
        gate.release()

    def interrupt(*_: Any) -> None:
        if not interrupted.is_set():
            interrupted.set()
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=interrupt_then_release, daemon=True)
    sender.start()
    try:
        yield
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, previous)
    assert interrupted.is_set(), "the gate was never reached: nothing was interrupted"


def _raised_the_interrupt(raised: pytest.ExceptionInfo[CheckpointException]) -> None:
    """DCP raised the interrupt to its caller inside its CheckpointException."""
    ((failure, _),) = raised.value.failures.values()
    assert isinstance(failure, KeyboardInterrupt)


def _settled(writer_or_reader: Any) -> None:
    """Every job of the plugin's runtime has ended (none left waiting on a gate or a lost
    caller), and no task is left on its loop."""
    runtime = writer_or_reader._started()
    _, running = concurrent.futures.wait(list(runtime._in_flight), timeout=60)
    assert not running, "a job of the interrupted call never ended"

    async def tasks_besides_this_one() -> int:
        return len(asyncio.all_tasks()) - 1

    assert runtime.call(tasks_besides_this_one()) == 0


def _save_previous(tmp_path: Any, backend: FaultyBackend) -> dict[str, Any]:
    previous = _state(1)
    dcp.save(previous, storage_writer=StorageWriter(f"{tmp_path}/step_1", backend=backend))
    return previous


def test_a_save_interrupted_while_planning_leaves_no_area_and_the_path_free(
        tmp_path: Any) -> None:
    """Cancelled at the plan (the coordinator's `prepare_global_plan` waits for the area):
    nothing at the path; once the writer is closed no area is left, live or on disk; the
    previous checkpoint loads bit-exactly; a new save to the same path commits. (Before, the
    area was made after the interrupt and held live by no writer: every later save to the
    path was refused as "in progress".)"""
    backend = FaultyBackend()
    previous = _save_previous(tmp_path, backend)
    held = backend.hold("start_save", where="step_2")
    writer = StorageWriter(f"{tmp_path}/step_2", backend=backend)
    with pytest.raises(CheckpointException) as raised, interrupted_once_reached(held):
        dcp.save(_state(2), storage_writer=writer)
    _raised_the_interrupt(raised)
    writer.close()
    _settled(writer)
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
    assert _open_files_under(tmp_path) == []
    assert_same(previous, _load(f"{tmp_path}/step_1", backend))
    dcp.save(_state(2), storage_writer=StorageWriter(f"{tmp_path}/step_2", backend=backend))
    assert_same(_state(2), _load(f"{tmp_path}/step_2", backend))


def test_a_save_interrupted_while_writing_stops_before_the_commit(tmp_path: Any) -> None:
    """Cancelled during the writes (DCP waits on `write_data`'s future; the interrupt takes
    effect as the writes end): DCP never calls `finish`, so nothing is at the path; closing
    the writer removes its area; no file stays open; the previous checkpoint loads
    bit-exactly; the same writer saves to the same path afterwards."""
    backend = FaultyBackend()
    previous = _save_previous(tmp_path, backend)
    held = backend.hold("write", where="step_2")
    writer = StorageWriter(f"{tmp_path}/step_2", backend=backend)
    with pytest.raises(CheckpointException) as raised, _interrupted_as_it_returns(held):
        dcp.save(_state(2), storage_writer=writer)
    _raised_the_interrupt(raised)
    assert not os.path.exists(f"{tmp_path}/step_2")
    writer.close()
    _settled(writer)
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
    assert _open_files_under(tmp_path) == []
    assert_same(previous, _load(f"{tmp_path}/step_1", backend))
    dcp.save(_state(2), storage_writer=writer)  # the writer is reset for its next save
    assert_same(_state(2), _load(f"{tmp_path}/step_2", backend))


def test_a_save_interrupted_in_the_commit_is_whole_and_the_next_save_commits(
        tmp_path: Any) -> None:
    """Cancelled at the commit (the coordinator waits in `finish`, the rename not made):
    the commit goes on to its end, so the path is the whole checkpoint, never half of one;
    no area or open file is left; the previous checkpoint loads bit-exactly; a save to the
    same path is refused (a checkpoint is never overwritten) and the next step's commits."""
    backend = FaultyBackend()
    previous = _save_previous(tmp_path, backend)
    held = backend.hold("commit", where="step_2")
    writer = StorageWriter(f"{tmp_path}/step_2", backend=backend)
    with pytest.raises(CheckpointException) as raised, interrupted_once_reached(held):
        dcp.save(_state(2), storage_writer=writer)
    _raised_the_interrupt(raised)
    _settled(writer)
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]
    assert _open_files_under(tmp_path) == []
    assert_same(previous, _load(f"{tmp_path}/step_1", backend))
    assert_same(_state(2), _load(f"{tmp_path}/step_2", backend))
    with pytest.raises(CheckpointException, match="expected a new path"):
        dcp.save(_state(2), storage_writer=StorageWriter(f"{tmp_path}/step_2",
                                                         backend=backend))
    dcp.save(_state(3), storage_writer=StorageWriter(f"{tmp_path}/step_3", backend=backend))
    assert_same(_state(3), _load(f"{tmp_path}/step_3", backend))


def test_an_interrupted_wait_on_async_save_leaves_its_save_to_commit_whole(
        tmp_path: Any) -> None:
    """`dcp.async_save`'s future cannot be cancelled once its thread runs the save, and an
    interrupt of the trainer's wait for it (here during the writes) ends only the wait: the
    save goes on and commits the whole checkpoint; no area or open file is left; the
    previous checkpoint loads bit-exactly; the next async save commits."""
    backend = FaultyBackend()
    previous = _save_previous(tmp_path, backend)
    held = backend.hold("write", where="step_2")
    future = dcp.async_save(_state(2), storage_writer=StorageWriter(f"{tmp_path}/step_2",
                                                                    backend=backend))
    with pytest.raises(KeyboardInterrupt), interrupted_once_reached(held):
        future.result()
    assert not future.cancel()
    future.result()
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]
    assert _open_files_under(tmp_path) == []
    assert_same(previous, _load(f"{tmp_path}/step_1", backend))
    assert_same(_state(2), _load(f"{tmp_path}/step_2", backend))
    dcp.async_save(_state(3), storage_writer=StorageWriter(f"{tmp_path}/step_3",
                                                           backend=backend)).result()
    assert_same(_state(3), _load(f"{tmp_path}/step_3", backend))


def test_a_load_interrupted_while_opening_leaves_no_lease(tmp_path: Any) -> None:
    """Cancelled while the reader opens the checkpoint (`read_metadata` waits; the open, and
    its lease, go on): once the runtime is idle the lease is ended (no lock file or data
    file of the checkpoint stays open, which would keep it from being pruned), the
    checkpoint is unchanged and a later load is bit-exact. (Before, the lease leaked.)"""
    backend = FaultyBackend()
    previous = _save_previous(tmp_path, backend)
    held = backend.hold("open_reader", where="step_1")
    reader = StorageReader(f"{tmp_path}/step_1", backend=backend)
    with pytest.raises(CheckpointException) as raised, interrupted_once_reached(held):
        dcp.load(_zeros(), storage_reader=reader)
    _raised_the_interrupt(raised)
    _settled(reader)
    assert _open_files_under(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
    assert_same(previous, _load(f"{tmp_path}/step_1", backend))


def test_a_load_interrupted_while_reading_leaves_the_checkpoint_intact(tmp_path: Any) -> None:
    """Cancelled during the reads (DCP waits on `read_data`'s future; the interrupt takes
    effect as the reads end): the target may hold what was read, but the checkpoint is
    unchanged and unleased (no file of it stays open), nothing is left on the runtime, and
    the same reader loads it bit-exactly afterwards."""
    backend = FaultyBackend()
    previous = _save_previous(tmp_path, backend)
    held = backend.hold("read", where="step_1/__0_")
    reader = StorageReader(f"{tmp_path}/step_1", backend=backend)
    with pytest.raises(CheckpointException) as raised, _interrupted_as_it_returns(held):
        dcp.load(_zeros(), storage_reader=reader)
    _raised_the_interrupt(raised)
    _settled(reader)
    assert _open_files_under(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
    target = _zeros()
    dcp.load(target, storage_reader=reader)  # DCP resets the reader for its next load
    assert_same(previous, target)
