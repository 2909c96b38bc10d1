"""The stage+write pipeline: few executor calls per save (a trainer's GIL is taken a few times,
not per item), waves under a small budget, the state dict read off the loop, 100k-item states."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from asynctron import Engine
from asynctron.engine import _pipeline, _save
from asynctron.storage.backends.local import _writer
from asynctron.testing import LoopWatchdog
from tests.conftest import assert_same

MiB = 1 << 20


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Record, per call of `module.name`, its first argument's length (batches per call)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counting(*args: object, **kwargs: object) -> object:
        batches = args[0] if name == "stage_wave" else args[3]
        calls.append(len(batches))  # type: ignore[arg-type]
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


async def test_a_state_that_fits_is_staged_in_one_call_and_written_in_one_call_per_bin(
        shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant: staging whatever fits the budget is ONE executor call, whatever its number of
    batches, segments and items; each bin is then written by ONE executor call."""
    staged = _count_calls(monkeypatch, _pipeline, "stage_wave")
    written = _count_calls(monkeypatch, _writer, "_write_batches")
    state = {f"w{i}": torch.randn(300_000) for i in range(40)}  # 46 MiB in 1 MiB slabs
    state.update({f"tiny{i}": torch.full((3,), i) for i in range(2000)})
    async with Engine(num_bins=2, slab_bytes=MiB, memory_budget_bytes=64 * MiB) as engine:
        await engine.save(state, f"{shm_path}/a")
        loaded = await engine.load(f"{shm_path}/a")
    assert_same(state, loaded)
    assert len(staged) == 1 and staged[0] >= 46
    assert len(written) == 2 and sum(written) == staged[0]


async def test_a_state_larger_than_the_budget_streams_in_waves(
        shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    staged = _count_calls(monkeypatch, _pipeline, "stage_wave")
    state = {f"w{i}": torch.randn(MiB // 4) for i in range(12)}  # 12 MiB, budget 3 MiB
    async with Engine(num_bins=2, slab_bytes=MiB, memory_budget_bytes=3 * MiB) as engine:
        await engine.save(state, f"{shm_path}/a")
        assert engine.budget.statistics().peak_borrowed_bytes <= 3 * MiB
        loaded = await engine.load(f"{shm_path}/a")
    assert_same(state, loaded)
    assert sum(staged) == 12 and max(staged) <= 3 and len(staged) >= 4


async def test_the_state_dict_is_read_off_the_loop(shm_path: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`save()` returns before reading the state dict; flattening (a microsecond per value,
    100 ms for 100k) runs on the engine's executor."""
    threads: list[str] = []
    real_flatten = _save.flatten

    def recording_flatten(*args: object, **kwargs: object) -> object:
        threads.append(threading.current_thread().name)
        return real_flatten(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_save, "flatten", recording_flatten)
    async with Engine() as engine:
        task = engine.save({"w": torch.ones(3)}, f"{shm_path}/a")
        assert threads == []
        await task
    assert len(threads) == 1 and threads[0].startswith("asynctron-io")


async def test_bad_leaves_fail_the_task_and_write_nothing(shm_path: str) -> None:
    async with Engine() as engine:
        await engine.save({"step": 1}, f"{shm_path}/step_1")
        task = engine.save({"w": torch.ones(2), "bad": {1, 2}}, f"{shm_path}/step_2")
        for milestone in (task.staged, task):
            with pytest.raises(TypeError, match=r"^value at key 'bad': expected a tensor"):
                await milestone
        with pytest.raises(TypeError, match=r"^state_dict: expected a dict, found list"):
            engine.save([1], f"{shm_path}/step_3")  # type: ignore[arg-type]
    assert sorted(os.listdir(shm_path)) == ["latest", "step_1"]


@pytest.mark.slow
async def test_many_tiny_tensors_pack_densely_and_keep_the_loop_free(shm_path: str) -> None:
    """One optimizer entry per parameter: 40k tensors of 4 floats. Small items are 64-byte
    aligned (not 4 KiB: 160 MiB of padding), and a cached save keeps the loop responsive."""
    state = {"optim": {"state": {i: {"exp_avg": torch.full((4,), float(i)),
                                     "exp_avg_sq": torch.full((4,), -float(i))}
                                 for i in range(20_000)}}, "step": 7}
    async with Engine() as engine:
        await engine.save(state, f"{shm_path}/a")
        async with LoopWatchdog() as dog:
            result = await engine.save(state, f"{shm_path}/b")  # the plan is cached now
        loaded = await engine.load(f"{shm_path}/b")
    assert_same(state, loaded)
    assert result.num_items == 40_000
    data_bytes = sum(os.path.getsize(f"{shm_path}/b/{name}") for name in result.files)
    assert data_bytes <= 40_000 * 64
    with open(f"{shm_path}/b/manifest.json") as f:
        assert len(json.load(f)["items"]) == 40_000
    print(f"40k tensors: loop worst delay {dog.report().worst_delay_s * 1e3:.1f} ms")
    assert dog.report().worst_delay_s < 0.5  # generous: a noisy 2-core machine
