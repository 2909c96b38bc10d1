"""Cancelling a save at each await point: the tmp dir goes, `latest` stays, the budget returns."""

from __future__ import annotations

import asyncio
import gc
import os
import threading

import pytest
import torch

from asynctron import Engine
from asynctron.testing import FaultyBackend

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


def _open_files_under(root: str) -> list[str]:
    """The files and directories under `root` (a test's checkpoint directory) that this
    process holds open. Only those: other descriptors come and go with no checkpoint's doing
    (the CUDA runtime, started by a pinned slab or the test's own CUDA use, opens /dev/nvidia*
    and more: 20 descriptors more on an H100, 2026-11-26)."""
    root = os.path.realpath(root)
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing (the listing's own descriptor is)
            continue
        if name == root or name.startswith(root + "/"):  # a removed file ends " (deleted)"
            names.append(name)
    return sorted(names)


def test_open_files_under_names_the_checkpoint_files_and_no_others(shm_path: str) -> None:
    """A checkpoint file left open is seen, deleted or not, and a descriptor of anything else
    (as the CUDA runtime's, opened by the save under test) is not."""
    elsewhere = os.open(os.devnull, os.O_RDONLY)
    path = f"{shm_path}/step_2.tmp/__0_0.distcp"
    os.mkdir(os.path.dirname(path))
    leaked = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert _open_files_under(shm_path) == [os.path.realpath(path)]
        os.unlink(path)
        assert _open_files_under(shm_path) == [f"{os.path.realpath(path)} (deleted)"]
    finally:
        os.close(leaked)
        os.close(elsewhere)
    assert _open_files_under(shm_path) == []


@pytest.mark.parametrize("cancel_after",
                         ["request", "first_yield", "during_open", "staged", "during_fsync"])
async def test_cancel_leaves_no_trace(shm_path: str, cancel_after: str) -> None:
    """Invariant: after a cancelled save, the previous checkpoint is `latest` and loads, no tmp
    dir remains, no file of the checkpoints stays open, and the whole memory budget is free.
    Each cancellation lands at its exact point: the fake backend holds the operation there
    until the save is cancelled."""
    backend = FaultyBackend()
    async with Engine(backend=backend, **SMALL) as engine:
        await engine.save({"step": 1}, f"{shm_path}/step_1")
        point = {"during_open": "open", "during_fsync": "fsync"}.get(cancel_after)
        gate = backend.hold(point) if point is not None else None  # type: ignore[arg-type]
        task = engine.save({"w": torch.ones(400_000), "step": 2}, f"{shm_path}/step_2")
        if cancel_after == "first_yield":
            await asyncio.sleep(0)
        elif cancel_after == "staged":
            await task.staged
        elif gate is not None:
            await gate.reached()
        assert task.cancel()
        if gate is not None:
            gate.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.budget.borrowed_bytes == 0
        assert _open_files_under(shm_path) == []
        assert (await engine.load(shm_path))["step"] == 1
    assert sorted(os.listdir(shm_path)) == ["latest", "step_1"]


async def test_a_cancellation_at_the_commit_finds_the_checkpoint_whole(shm_path: str) -> None:
    """Invariant: once every rank has written, the commit runs to its end (the other ranks
    wait in its collectives): a cancellation that arrives then leaves the whole checkpoint,
    named by `latest`, and nothing else, and is raised to the caller."""
    backend = FaultyBackend()
    async with Engine(backend=backend, **SMALL) as engine:
        await engine.save({"step": 1}, f"{shm_path}/step_1")
        gate = backend.hold("commit")
        task = engine.save({"w": torch.ones(400_000), "step": 2}, f"{shm_path}/step_2")
        await gate.reached()
        assert task.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.budget.borrowed_bytes == 0
        assert (await engine.load(shm_path))["step"] == 2
    assert sorted(os.listdir(shm_path)) == ["latest", "step_1", "step_2"]


async def test_cancelling_a_load_while_it_opens_files_leaves_none_open(shm_path: str) -> None:
    backend = FaultyBackend()
    async with Engine(backend=backend, **SMALL) as engine:
        await engine.save({"w": torch.ones(400_000)}, f"{shm_path}/step_1")
        gate = backend.hold("read")
        load = asyncio.create_task(engine.load(f"{shm_path}/step_1"))
        await gate.reached()
        load.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await load
        assert _open_files_under(shm_path) == []


async def test_cancelling_the_awaiter_does_not_cancel_the_save(shm_path: str) -> None:
    """`await task` is shielded: a caller's timeout does not abort the checkpoint."""
    async with Engine(**SMALL) as engine:
        task = engine.save({"w": torch.ones(400_000)}, f"{shm_path}/s")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.ensure_future(_await(task)), timeout=0)
        result = await task
    assert result.nbytes == 1_600_000


async def _await(task: object) -> object:
    return await task  # type: ignore[misc]


async def test_closing_the_engine_waits_for_saves_in_flight(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        task = engine.save({"w": torch.ones(400_000)}, f"{shm_path}/s")
    assert task.done() and (await task).nbytes == 1_600_000


async def test_cancelling_while_planning_commits_nothing(
        shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancellation that arrives while the save plans (on the executor) aborts it too:
    nothing is written, the tmp dir goes, `latest` stays where it was."""
    from asynctron.engine import _save

    real_file_plan = _save.file_plan
    planning, cancelled = threading.Event(), threading.Event()

    def slow_file_plan(*args: object, **kwargs: object) -> object:
        planning.set()
        cancelled.wait(30)  # the plan finishes only once the save was cancelled
        return real_file_plan(*args, **kwargs)  # type: ignore[arg-type]

    async with Engine(**SMALL) as engine:
        await engine.save({"w": torch.ones(10)}, f"{shm_path}/step_1")
        monkeypatch.setattr(_save, "file_plan", slow_file_plan)
        task = engine.save({"w": torch.zeros(10), "other": torch.ones(2)}, f"{shm_path}/step_2")
        assert await asyncio.get_running_loop().run_in_executor(None, planning.wait, 30)
        task.cancel()
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert sorted(os.listdir(shm_path)) == ["latest", "step_1"]


def test_a_loop_that_ends_with_a_save_in_flight_says_so(shm_path: str) -> None:
    """`asyncio.run` cancels what is left when its coroutine returns: a save nobody awaited,
    on an engine nobody closed, is then not silently lost."""

    async def main() -> None:
        engine = Engine(**SMALL)
        await engine.start()
        engine.save({"w": torch.ones(100_000)}, f"{shm_path}/step_1")  # neither awaited nor closed

    with pytest.warns(RuntimeWarning, match=r"checkpoint .*/step_1: the save was cancelled before "
                                            r"it committed.*asyncio\.run returned"):
        asyncio.run(main())
    assert os.listdir(shm_path) == []


async def test_cancelling_through_the_task_or_the_engine_is_silent(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        engine.save({"w": torch.ones(100_000)}, f"{shm_path}/a").cancel()
    with pytest.raises(RuntimeError, match="trainer failed"):
        async with Engine(**SMALL) as engine:
            engine.save({"w": torch.ones(100_000)}, f"{shm_path}/b")
            raise RuntimeError("trainer failed")
    assert os.listdir(shm_path) == []


async def test_a_cancelled_call_whose_thread_fails_logs_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """The cancellation wins over the thread's error, and that error is not left for the
    garbage collector to log as "never retrieved" (on whatever thread collects it)."""
    started, release = threading.Event(), threading.Event()

    def fail_later() -> None:
        started.set()
        release.wait(5)
        raise OSError("disk went away")

    async with Engine() as engine:
        call = asyncio.ensure_future(engine.run_blocking(fail_later))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        call.cancel()
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await call
    gc.collect()
    await asyncio.sleep(0)  # the loop runs the exception handler's report, if any
    assert "never retrieved" not in caplog.text
