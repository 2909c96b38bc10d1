"""The coordinator's commit and the tmp dir's life: a save's tmp dir is found from its path
alone (DCP's plan caching hands later saves the first one's plans); an interrupt while the
coordinator waits in `finish` never splits the commit from the tmp dir's removal; a writer
freed by a garbage collection inside a runtime call does not deadlock it; a dead save's tmp
dir at the same path is replaced, a live one's refused."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from asynctron.dcp import StorageReader, StorageWriter
from asynctron.dcp._commit import area_of
from asynctron.storage import LocalBackend
from asynctron.testing import FaultyBackend
from tests.conftest import assert_same, interrupted_once_reached


def leftovers(root: Any) -> list[str]:
    return sorted(name for name in os.listdir(root) if ".tmp-" in name)


@pytest.fixture
def no_cached_plans() -> Iterator[None]:
    """DCP's plan cache is class-level: empty before and after the test."""
    caches = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan",
              "_cached_metadata", "_cached_final_save_plan")

    def clear() -> None:
        for name in caches:
            getattr(SavePlanner, name, {}).clear()

    clear()
    yield
    clear()


@pytest.mark.usefixtures("no_cached_plans")
def test_plan_caching_saves_every_time(tmp_path: Any) -> None:
    state = {"w": torch.randn(100, 10), "step": 1}
    for step in range(3):
        state["w"].add_(1)
        dcp.save(state, storage_writer=StorageWriter(f"{tmp_path}/step{step}"),
                 planner=DefaultSavePlanner(enable_plan_caching=True))
        target = {"w": torch.zeros(100, 10), "step": 0}
        dcp.load(target, storage_reader=StorageReader(f"{tmp_path}/step{step}"))
        assert_same(state, target)
    assert sorted(os.listdir(tmp_path)) == ["step0", "step1", "step2"]


def test_an_interrupt_in_finish_never_splits_the_commit(tmp_path: Any) -> None:
    """Ctrl-C reaches the coordinator while it waits for the commit (the rename not yet made):
    the tmp dir is never removed under the commit, so once the runtime is idle the path is
    the whole checkpoint (the commit went on) and no tmp dir is left. Before, the interrupt
    removed the tmp dir while the rename was still to come."""
    backend = FaultyBackend()
    held = backend.hold("commit")
    state = {"w": torch.randn(1000, 100), "v": torch.randn(5000)}
    writer = StorageWriter(f"{tmp_path}/ck", backend=backend, num_workers=4)
    with pytest.raises((KeyboardInterrupt, CheckpointException)), interrupted_once_reached(held):
        dcp.save(state, storage_writer=writer)
    runtime = writer._started()
    concurrent.futures.wait(list(runtime._in_flight))
    assert leftovers(tmp_path) == [] and os.listdir(tmp_path) == ["ck"]
    target = {"w": torch.zeros(1000, 100), "v": torch.zeros(5000)}
    dcp.load(target, storage_reader=StorageReader(f"{tmp_path}/ck"))
    assert_same(state, target)


def _pending_garbage(path: str) -> None:
    """A coordinator's writer with a tmp dir made, left as cyclic garbage."""
    writer = StorageWriter(path, num_bins=7)
    writer.set_up_storage_writer(True)
    writer.prepare_global_plan([SavePlan([])])
    writer.cycle = writer  # type: ignore[attr-defined]


def test_a_writer_freed_inside_a_runtime_call_does_not_deadlock(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A garbage collection inside `Runtime.start` (under its lock) frees a writer whose
    finalizer removes its tmp dir: it only schedules, so `start` goes on (it re-entered the
    lock and deadlocked), and the tmp dir is removed."""
    runtime = StorageWriter(f"{tmp_path}/x", num_bins=7)._started()  # options of its own
    real = asyncio.run_coroutine_threadsafe
    collected = threading.Event()

    def with_gc(coroutine: Any, loop: Any) -> Any:  # a collection from an allocation
        if not collected.is_set():
            collected.set()
            gc.collect()
        return real(coroutine, loop)

    async def nothing() -> None:
        return None

    gc.disable()
    try:
        _pending_garbage(f"{tmp_path}/ck")
        assert len(leftovers(tmp_path)) == 1
        monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", with_gc)
        caller = threading.Thread(target=lambda: runtime.start(nothing()).result(),
                                  daemon=True)
        caller.start()
        caller.join(timeout=30)  # a guard against the deadlock, not a timing
        assert not caller.is_alive(), "Runtime.start deadlocked in the writer's finalizer"
    finally:
        gc.enable()
    monkeypatch.undo()
    runtime.call(nothing())  # the finalizer's removal was scheduled before this
    concurrent.futures.wait(list(runtime._in_flight))
    assert collected.is_set() and leftovers(tmp_path) == []


def test_a_dead_saves_tmp_dir_is_replaced_a_live_ones_refused(tmp_path: Any) -> None:
    stale = pathlib.Path(_area(f"{tmp_path}/ck"))
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(f"{tmp_path}/ck"))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert_same({"w": torch.ones(3)}, _load(f"{tmp_path}/ck"))

    live = StorageWriter(f"{tmp_path}/d")
    live.set_up_storage_writer(True)
    live.prepare_global_plan([SavePlan([])])
    with pytest.raises(CheckpointException, match="another save to this path is in progress"):
        dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(f"{tmp_path}/d"))
    assert leftovers(tmp_path) == [os.path.basename(_area(f"{tmp_path}/d"))]
    live.close()
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def _area(path: str) -> str:
    """Where a DCP save to `path` makes its tmp dir (every rank finds it from the path)."""
    return area_of(LocalBackend().checkpoints(asyncio.to_thread), path).location


def _load(path: str) -> dict[str, Any]:
    target = {"w": torch.zeros(3)}
    dcp.load(target, storage_reader=StorageReader(path))
    return target
