"""`keep_last` prunes only what its job committed, in commit order, never a checkpoint being
loaded; the debris of dead saves is removed, a live save's never."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import asynctron
from asynctron import Engine
from asynctron.storage.backends.local import _publish as _commit
from asynctron.storage.backends.local._publish import read_latest
from asynctron.storage.backends.local._retention import LEDGER_NAME, lease_checkpoint, read_ledger
from asynctron.testing import FaultyBackend

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


def _checkpoints(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if name not in ("latest", LEDGER_NAME))


async def test_keep_last_never_deletes_checkpoints_it_did_not_commit(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        await engine.save({"w": torch.ones(3)}, f"{shm_path}/pretrained_base")
    async with Engine(keep_last=1, job="eval", **SMALL) as engine:
        await engine.save({"w": torch.ones(3)}, f"{shm_path}/best_eval")
    os.mkdir(f"{shm_path}/notes")  # never an asynctron checkpoint
    async with Engine(keep_last=2, **SMALL) as engine:
        results = [await engine.save({"s": s}, f"{shm_path}/step_{s}") for s in (1, 2, 3)]
    assert _checkpoints(shm_path) == ["best_eval", "notes", "pretrained_base", "step_2",
                                      "step_3"]
    assert [r.pruned for r in results] == [(), (), (f"{shm_path}/step_1",)]
    assert (await asyncio.to_thread(asynctron.load, f"{shm_path}/best_eval"))["w"].sum() == 3


async def test_a_clock_moved_back_after_a_restart_prunes_by_commit_order(
        shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with Engine(keep_last=2, job="run", **SMALL) as engine:
        for step in (1, 2):
            await engine.save({"step": step}, f"{shm_path}/step_{step}")
    day_ago = time.time() - 86_400
    monkeypatch.setattr(time, "time", lambda: day_ago)  # the restarted host's clock is behind
    async with Engine(keep_last=2, job="run", **SMALL) as engine:
        for step in (3, 4):
            await engine.save({"step": step}, f"{shm_path}/step_{step}")
    assert _checkpoints(shm_path) == ["step_3", "step_4"]


async def test_a_restart_without_a_job_name_prunes_only_its_own(shm_path: str) -> None:
    for steps in ((1, 2, 3), (4, 5, 6)):
        async with Engine(keep_last=1, **SMALL) as engine:
            for step in steps:
                await engine.save({"step": step}, f"{shm_path}/step_{step}")
    assert _checkpoints(shm_path) == ["step_3", "step_6"]


async def test_a_replaced_checkpoint_is_forgotten_not_deleted(shm_path: str) -> None:
    async with Engine(keep_last=1, job="run", **SMALL) as engine:
        await engine.save({"step": 1}, f"{shm_path}/step_1")
        await asyncio.to_thread(shutil.rmtree, f"{shm_path}/step_1")
        await asyncio.to_thread(asynctron.save, {"by": "hand"}, f"{shm_path}/step_1")
        await engine.save({"step": 2}, f"{shm_path}/step_2")
    assert _checkpoints(shm_path) == ["step_1", "step_2"]
    assert [entry.name for entry in read_ledger(shm_path)] == ["step_2"]


@pytest.mark.parametrize("keep_last", [1, 2])
async def test_a_slow_older_save_neither_survives_nor_evicts_newer_ones(
        shm_path: str, keep_last: int) -> None:
    """Within one engine, order is request order, even when an older save commits last."""
    backend = FaultyBackend()
    async with Engine(keep_last=keep_last, backend=backend, **SMALL) as engine:
        gates = [backend.hold("fsync", where=f"step_{s}") for s in (2, 4, 6)]
        tasks = [engine.save({"s": torch.full((10,), s)}, f"{shm_path}/step_{s}")
                 for s in (2, 4, 6)]
        for gate in gates:
            await gate.reached()
        for gate in gates:  # the oldest save's files are the last to be durable
            gate.release()
        await asyncio.gather(*tasks)
    assert _checkpoints(shm_path) == ["step_4", "step_6"][-keep_last:]
    assert read_latest(shm_path) == f"{shm_path}/step_6"


async def test_a_checkpoint_being_loaded_is_pruned_only_after_the_load(shm_path: str) -> None:
    async with Engine(keep_last=1, **SMALL) as engine:
        await engine.save({"step": 1}, f"{shm_path}/step_1")
        path, lease = await asyncio.to_thread(lease_checkpoint, shm_path)  # a reader elsewhere
        assert path == f"{shm_path}/step_1"
        kept = await engine.save({"step": 2}, f"{shm_path}/step_2")
        assert kept.pruned == () and _checkpoints(shm_path) == ["step_1", "step_2"]
        lease.release()
        pruned = await engine.save({"step": 3}, f"{shm_path}/step_3")
    assert pruned.pruned == (f"{shm_path}/step_1", f"{shm_path}/step_2")
    assert _checkpoints(shm_path) == ["step_3"]


async def test_hostile_ledger_lines_are_ignored_never_followed(
        shm_path: str, caplog: pytest.LogCaptureFixture) -> None:
    outside = f"{shm_path}/outside"
    os.makedirs(f"{outside}/victim")
    root = f"{shm_path}/root"
    async with Engine(keep_last=1, job="run", **SMALL) as engine:
        await engine.save({"step": 1}, f"{root}/step_1")
        victim = os.stat(f"{outside}/victim")
        with open(f"{root}/{LEDGER_NAME}", "a") as ledger:
            for name in ("../outside/victim", "..", "latest"):
                ledger.write(json.dumps({"job": "run", "name": name, "engine": "x", "seq": 0,
                                         "manifest": [victim.st_ino, victim.st_mtime_ns]}))
                ledger.write("\n")
            ledger.write("not json\n")
        with caplog.at_level(logging.WARNING, logger="asynctron"):
            await engine.save({"step": 2}, f"{root}/step_2")
            await engine.save({"step": 3}, f"{root}/step_3")
    assert os.path.isdir(f"{outside}/victim")
    assert _checkpoints(root) == ["step_3"]
    assert sum("ledger" in r.message and "ignored" in r.message for r in caplog.records) == 4


async def test_a_commit_removes_dead_saves_debris_never_a_live_saves_tmp_dir(
        shm_path: str) -> None:
    # Killed saves' tmp dirs, which nobody holds (the second as earlier versions named it):
    dead = [".asynctron.tmp-0dead", ".step_0.tmp-host-1-dead"]
    for name in dead:
        os.makedirs(f"{shm_path}/{name}")
    with open(f"{shm_path}/latest.tmp-1-dead", "w"):
        pass
    backend = FaultyBackend()
    async with Engine(backend=backend, **SMALL) as slow, Engine(**SMALL) as fast:
        held = backend.hold("fsync", where="slow")
        in_flight = slow.save({"w": torch.ones(10)}, f"{shm_path}/slow")
        await held.reached()  # its tmp dir is live, its file being made durable
        await fast.save({"w": torch.ones(10)}, f"{shm_path}/fast")
        hidden = [name for name in os.listdir(shm_path) if name.startswith(".")]
        assert len(hidden) == 1 and hidden[0] not in dead  # the live one stays
        assert hidden[0].startswith(".asynctron.tmp-")
        held.release()
        await in_flight
    assert sorted(os.listdir(shm_path)) == ["fast", "latest", "slow"]


def test_job_name_is_validated() -> None:
    for bad in ("", "a\nb", 7, "x" * 257):
        with pytest.raises(ValueError, match="job: expected"):
            Engine(keep_last=1, job=bad)


# Several processes in one root ----------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, torch, uvloop
    from asynctron import Engine

    async def main(root, prefix, count, keep_last, job):
        async with Engine(keep_last=keep_last, job=job or None, slab_bytes=1 << 16,
                          memory_budget_bytes=1 << 18) as engine:
            for step in range(count):
                await engine.save({"step": step, "w": torch.full((20_000,), step)},
                                  f"{root}/{prefix}{step}")
                print(step, flush=True)

    uvloop.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
""")

READER = textwrap.dedent("""
    import sys, time, uvloop
    from asynctron import Engine

    async def main(root, seconds):
        loads, end = 0, time.monotonic() + seconds
        async with Engine() as engine:
            while time.monotonic() < end:
                state = await engine.load(root)  # `latest`, while the writer prunes
                assert int(state["w"][0]) == state["step"], state["step"]
                loads += 1
        print(loads, flush=True)

    uvloop.run(main(sys.argv[1], float(sys.argv[2])))
""")


def _spawn(script: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_two_processes_pruning_one_root_keep_each_others_work(shm_path: str) -> None:
    writers = [_spawn(WRITER, shm_path, prefix, 12, 2, "") for prefix in ("a_", "b_")]
    for writer in writers:
        _, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err
    assert _checkpoints(shm_path) == ["a_10", "a_11", "b_10", "b_11"]
    for name in _checkpoints(shm_path):
        assert int(asynctron.load(f"{shm_path}/{name}")["step"]) == int(name[2:])


@pytest.mark.slow
def test_a_reader_of_latest_never_fails_while_a_writer_prunes(shm_path: str) -> None:
    asynctron.save({"step": 0, "w": torch.zeros(20_000)}, f"{shm_path}/s_init")
    reader = _spawn(READER, shm_path, 4.0)
    writer = _spawn(WRITER, shm_path, "s_", 40, 1, "run")
    out, err = reader.communicate(timeout=120)
    _, writer_err = writer.communicate(timeout=120)  # reaped even when the reader failed
    assert reader.returncode == 0, err
    assert int(out) > 0
    assert writer.returncode == 0, writer_err
    # The last pruning may have been deferred by a load in progress (one the reader began any
    # number of commits earlier, on a loaded machine): at most one left over.
    left = _checkpoints(shm_path)
    assert {"s_39", "s_init"} <= set(left) and len(left) <= 3, left


async def test_a_pointer_moved_and_pruned_between_its_read_and_the_check_is_read_again(
        shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the test above meets now and then, made to happen: a writer commits, moves
    `latest` and prunes the checkpoint the reader had just read from the pointer."""
    async with Engine(keep_last=1, job="run", **SMALL) as engine:
        await engine.save({"step": 1}, f"{shm_path}/step_1")
        real_read_latest, reads = _commit.read_latest, []

        async def commit_step_2() -> None:
            await engine.save({"step": 2}, f"{shm_path}/step_2")

        def read_latest(root: str) -> str | None:
            named = real_read_latest(root)
            if not reads:  # the writer's next commit lands right after this first read
                asyncio.run_coroutine_threadsafe(commit_step_2(), loop).result()
            reads.append(named)
            return named

        loop = asyncio.get_running_loop()
        monkeypatch.setattr(_commit, "read_latest", read_latest)
        state = await asyncio.to_thread(asynctron.load, shm_path)
    assert state["step"] == 2
    assert reads == [f"{shm_path}/step_1", f"{shm_path}/step_2"]
    assert _checkpoints(shm_path) == ["step_2"]


@pytest.mark.slow
def test_sigkilled_pruning_writers_lose_no_checkpoint_and_leave_no_debris(
        shm_path: str) -> None:
    """Two jobs' writers in one root, killed at random points of saving and pruning: every
    checkpoint `latest` or the ledger names loads; each job's next writer leaves only its
    newest checkpoints and no debris."""
    for round_ in range(4):
        writers = [_spawn(WRITER, shm_path, f"{job}{round_}_", 1000, 2, job) for job in "ab"]
        for delay_s, writer in zip((0.03 * round_, 0.07 * round_), writers, strict=True):
            with writer:
                assert writer.stdout is not None
                writer.stdout.readline()  # at least one commit in this round
                time.sleep(delay_s)
                writer.send_signal(signal.SIGKILL)
                writer.communicate(timeout=30)
        assert asynctron.load(shm_path)["step"] >= 0  # `latest`
        for entry in read_ledger(shm_path):
            if os.path.isdir(f"{shm_path}/{entry.name}"):
                asynctron.load(f"{shm_path}/{entry.name}")
    finals = [_spawn(WRITER, shm_path, f"final_{job}", 2, 2, job) for job in "ab"]
    for final in finals:
        _, err = final.communicate(timeout=120)
        assert final.returncode == 0, err
    assert _checkpoints(shm_path) == ["final_a0", "final_a1", "final_b0", "final_b1"]
