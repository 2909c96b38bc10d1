"""Engine save/load round trips: every dtype and shape, snapshots, in-place and mmap loads."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading

import numpy as np
import pytest
import torch

import asynctron
from asynctron import BusyError, ClosedError, Engine, EngineConfig
from asynctron.engine._config import EngineOptions
from asynctron.storage.format._dtypes import TORCH_DTYPES
from tests.conftest import assert_same

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Arbitrary bytes of `dtype` (every bit pattern, NaNs included)."""
    numel = int(np.prod(shape)) if shape else 1
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _every_kind_of_tensor() -> dict:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {f"dtype_{name}": _random((3, 5), dtype, i)
             for i, (name, dtype) in enumerate(TORCH_DTYPES.items())}
    state.update({
        "zero_dim": torch.tensor(3.5),
        "zero_elements": torch.empty(0, 7),
        "slice_view": base[2:4],  # contiguous view into a bigger storage
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(4.0).expand(3, 4),  # stride 0
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "shared_a": base,
        "shared_b": base,  # the same storage twice
        "big": _random((300_000,), torch.float32, 99),  # spans many 64 KiB slabs
        "np_array": np.arange(12, dtype=np.int16).reshape(3, 4),
        "np_readonly": np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8),
        "blob": b"\x00bytes\xff",
        "nested": {"list": [1, 2.5, None, True, "s"], "tuple": (1, (2, 3)), 7: {"deep": [[]]}},
        "nan": float("nan"),
    })
    return state


@pytest.mark.parametrize("num_bins", [1, 3])
@pytest.mark.parametrize("snapshot", [True, False])
async def test_round_trip_is_bit_exact(shm_path: str, num_bins: int, snapshot: bool) -> None:
    state = _every_kind_of_tensor()
    path = os.path.join(shm_path, "step_1")
    async with Engine(num_bins=num_bins, **SMALL) as engine:
        result = await engine.save(state, path, snapshot=snapshot)
        loaded = await engine.load(path)
        mapped = await engine.load(path, mmap=True)
    assert result.path == path and result.num_items == len(TORCH_DTYPES) + 14
    assert 0 < result.stage_s <= result.write_s <= result.total_s
    assert_same(state, loaded)
    assert_same(state, mapped)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert all(item["offset"] % (4096 if item["nbytes"] >= 4096 else 64) == 0
               for item in manifest["items"] if item["nbytes"])
    assert len(manifest["files"]) == num_bins


async def test_mutating_after_staged_does_not_change_the_checkpoint(shm_path: str) -> None:
    weights = torch.ones(200_000)
    async with Engine(**SMALL) as engine:
        task = engine.save({"w": weights}, os.path.join(shm_path, "a"))
        await task.staged
        weights.fill_(7.0)  # the trainer's next step
        await task
        loaded = await engine.load(os.path.join(shm_path, "a"))
    assert torch.equal(loaded["w"], torch.ones(200_000))


async def test_load_into_fills_tensors_in_place(shm_path: str) -> None:
    state = {"model": {"w": torch.randn(50, 50), "t": torch.randn(8, 5)}, "step": 10,
             "arr": np.arange(5.0)}
    async with Engine(**SMALL) as engine:
        await engine.save(state, shm_path + "/c")
        # "t": the saved shape [8, 5], transposed (not square, so a target of the wrong shape
        # is refused rather than filled)
        target = {"model": {"w": torch.zeros(50, 50), "t": torch.zeros(5, 8).t()}, "step": 0,
                  "arr": np.zeros(5)}
        w, t, arr = target["model"]["w"], target["model"]["t"], target["arr"]
        assert not t.is_contiguous()
        result = await engine.load_into(target, shm_path + "/c")
    assert result["model"]["w"] is w and torch.equal(w, state["model"]["w"])
    assert result["model"]["t"] is t and torch.equal(t, state["model"]["t"])  # through slabs
    assert np.array_equal(arr, state["arr"]) and result["step"] == 10


async def test_load_into_rejects_mismatches_by_key(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        await engine.save({"w": torch.zeros(4, 4)}, shm_path + "/c")
        with pytest.raises(ValueError, match=r"^key 'w': expected torch\.float32 \[4, 4\] as "
                                             r"saved, found torch\.float32 \[4, 5\] in the "
                                             r"state dict"):
            await engine.load_into({"w": torch.zeros(4, 5)}, shm_path + "/c")
        with pytest.raises(ValueError, match=r"^key 'v': expected in checkpoint .*found no"):
            await engine.load_into({"v": torch.zeros(4, 4)}, shm_path + "/c")
        with pytest.raises(TypeError, match=r"^state_dict: expected a dict, found list; "):
            await engine.load_into([torch.zeros(4, 4)], shm_path + "/c")  # type: ignore[arg-type]


async def test_keys_that_alias_once_joined_are_refused_at_save(shm_path: str) -> None:
    """`{"a.b": 1, "a": {"b": 2}}` would load back by `load_into` as 1 and 1: never saved."""
    async with Engine(**SMALL) as engine:
        task = engine.save({"a.b": 1, "a": {"b": 2}}, shm_path + "/c")
        with pytest.raises(ValueError, match=r"^state dict key 'a\.b': two different paths"):
            await task
    assert os.listdir(shm_path) == []


@pytest.mark.parametrize("aliasing", ["two values", "a value and an item"])
async def test_into_refuses_an_older_checkpoint_whose_keys_alias(shm_path: str,
                                                                   aliasing: str) -> None:
    """Such a checkpoint (saved before save refused aliasing keys) loads whole with load();
    load_into cannot tell the two apart and says so, naming the key."""
    path = f"{shm_path}/c"
    async with Engine(**SMALL) as engine:
        await engine.save({"a": {"b": torch.ones(2) if aliasing != "two values" else 2}}, path)
        with open(f"{path}/manifest.json") as f:
            manifest = json.load(f)
        manifest["structure"]["dict"].insert(0, ["a.b", {"value": 1}])  # as an older save wrote
        with open(f"{path}/manifest.json", "w") as f:
            json.dump(manifest, f)
        whole = await engine.load(path)
        assert whole["a.b"] == 1 and list(whole["a"]) == ["b"]
        with pytest.raises(asynctron.CorruptCheckpointError,
                           match=r"^checkpoint .*/c: key 'a\.b' names two values once its parts "
                                 r"are joined, so load_into cannot tell them apart") as raised:
            await engine.load_into({"a": {"b": torch.zeros(2)} if aliasing != "two values"
                                    else {"b": 0}}, path)
    assert raised.value.key == "a.b"


async def test_mmap_tensors_are_copy_on_write(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        await engine.save({"w": torch.zeros(1000)}, shm_path + "/c")
        mapped = await engine.load(shm_path + "/c", mmap=True)
        mapped["w"].fill_(1.0)
        again = await engine.load(shm_path + "/c")
    assert torch.equal(again["w"], torch.zeros(1000))


async def test_latest_follows_the_newest_commit_and_keep_last_prunes(shm_path: str) -> None:
    async with Engine(keep_last=2, **SMALL) as engine:
        for step in range(4):
            await engine.save({"step": step, "w": torch.full((10,), step)},
                              f"{shm_path}/step_{step}")
        latest = await engine.load(shm_path)
    assert latest["step"] == 3
    assert sorted(os.listdir(shm_path)) == [".asynctron-ledger", "latest", "step_2", "step_3"]


async def test_existing_target_and_duplicate_in_flight_path(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        await engine.save({"a": 1}, shm_path + "/c")
        with pytest.raises(FileExistsError, match=r"checkpoint .*/c: expected a new path"):
            await engine.save({"a": 2}, shm_path + "/c")
        first = engine.save({"w": torch.zeros(100_000)}, shm_path + "/d")
        with pytest.raises(BusyError, match=r"a save to this path is already in flight"):
            engine.save({"a": 1}, shm_path + "/d")
        await first
        assert (await engine.load(shm_path + "/c"))["a"] == 1
    assert sorted(os.listdir(shm_path)) == ["c", "d", "latest"]


async def test_many_saves_in_flight_share_the_budget(shm_path: str) -> None:
    states = [{"w": torch.full((100_000,), float(i))} for i in range(5)]
    async with Engine(**SMALL) as engine:
        tasks = [engine.save(s, f"{shm_path}/s{i}") for i, s in enumerate(states)]
        results = await asyncio.gather(*tasks)
        assert engine.budget.statistics().peak_borrowed_bytes <= SMALL["memory_budget_bytes"]
        assert engine.budget.borrowed_bytes == 0
        for i, result in enumerate(results):
            assert torch.equal((await engine.load(result.path))["w"], states[i]["w"])


async def test_closed_engine_refuses_work(shm_path: str) -> None:
    engine = Engine(**SMALL)
    async with engine:
        pass
    with pytest.raises(ClosedError, match=r"^engine: closed; create a new Engine$"):
        engine.save({"a": 1}, shm_path + "/x")


async def test_result_on_the_loop_thread_is_refused(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        task = engine.save({"a": torch.ones(3)}, shm_path + "/x")
        with pytest.raises(RuntimeError, match=r"called on the event loop thread"):
            task.result()
        await task


def test_background_engine_serves_a_sync_trainer(shm_path: str) -> None:
    weights = torch.ones(100_000)
    with asynctron.BackgroundEngine(**SMALL) as engine:
        task = engine.save({"w": weights}, shm_path + "/bg")
        task.staged.result(timeout=30)
        weights.zero_()
        result = task.result(timeout=30)
        loaded = engine.load(shm_path + "/bg")
    assert result.nbytes == 400_000 and torch.equal(loaded["w"], torch.ones(100_000))


def test_one_call_helpers(shm_path: str) -> None:
    result = asynctron.save({"x": torch.arange(5)}, shm_path + "/one")
    assert result.files == ("__0_0.distcp",)
    assert torch.equal(asynctron.load(shm_path)["x"], torch.arange(5))


async def test_one_call_helpers_refuse_a_running_loop(shm_path: str) -> None:
    with pytest.raises(RuntimeError, match=r"inside a running event loop"):
        asynctron.save({"x": 1}, shm_path + "/one")


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^num_bins: expected an int >= 1, found 0$"):
        Engine(num_bins=0)
    with pytest.raises(ValueError, match=r"^slab_bytes: expected a multiple of 4096"):
        Engine(slab_bytes=1000)
    with pytest.raises(ValueError, match=r"^memory_budget_bytes: expected an int >= slab_bytes"):
        Engine(slab_bytes=1 << 20, memory_budget_bytes=1 << 10)
    with pytest.raises(ValueError, match=r"^worker_nice_increment: expected an int in \[0, 19\], "
                                         r"found -5$"):
        Engine(worker_nice_increment=-5)


def test_config_object_or_keywords_never_both() -> None:
    config = EngineConfig(num_workers=3, slab_bytes=1 << 16)
    assert Engine(config).config is config and Engine(config=config).config is config
    assert Engine(num_workers=3, slab_bytes=1 << 16).config == config
    with pytest.raises(TypeError, match=r"^Engine num_workers: expected config= or EngineConfig "
                                        r"fields as keywords, found both; pass "
                                        r"EngineConfig\(\.\.\., num_workers=\.\.\.\) as "
                                        r"config, or only keywords$"):
        Engine(config, num_workers=2)
    with pytest.raises(TypeError, match=r"^Engine config: expected EngineConfig, found dict$"):
        Engine({"num_workers": 2})  # type: ignore[arg-type]


def test_keyword_options_are_the_config_fields() -> None:
    assert set(EngineOptions.__annotations__) == {f.name for f in dataclasses.fields(EngineConfig)}


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
async def test_worker_threads_yield_the_cpu_to_the_loop() -> None:
    """The executor's threads run at a lower CPU priority than the thread that started the
    engine, so a waking event loop gets a core before checkpoint copies do."""
    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async with Engine(worker_nice_increment=7) as engine:
        assert await engine.run_blocking(nice) == min(19, nice() + 7)
    async with Engine(worker_nice_increment=0) as engine:
        assert await engine.run_blocking(nice) == nice()


@pytest.mark.slow
async def test_tensor_larger_than_2_gib(shm_path: str) -> None:
    """Single tensors over the 2 GiB syscall limit stream through slabs and read back."""
    huge = torch.empty((2 << 30) + 4096 * 3 + 5, dtype=torch.uint8)
    huge[:: 1 << 20] = 7
    huge[-5:] = torch.arange(5, dtype=torch.uint8)
    async with Engine(memory_budget_bytes=256 << 20, num_bins=1) as engine:  # one item
        await engine.save({"huge": huge}, shm_path + "/h")
        loaded = await engine.load(shm_path + "/h")
    assert torch.equal(loaded["huge"], huge)


async def test_a_large_tensor_spreads_over_bins_and_loads_every_way(shm_path: str) -> None:
    """A tensor larger than its share of the bins is cut into row chunks, one per file; fresh,
    in-place (contiguous and strided targets) and mmap loads all assemble it bit-exact."""
    state = {"big": _random((40, 1 << 19), torch.float32, 5), "small": torch.ones(3)}
    async with Engine(num_bins=2) as engine:
        await engine.save(state, f"{shm_path}/c")
        fresh = await engine.load(f"{shm_path}/c")
        mapped = await engine.load(f"{shm_path}/c", mmap=True)
        contiguous = {"big": torch.zeros(40, 1 << 19), "small": torch.zeros(3)}
        await engine.load_into(contiguous, f"{shm_path}/c")
        strided = {"big": torch.zeros(1 << 19, 40).t(), "small": torch.zeros(3)}
        await engine.load_into(strided, f"{shm_path}/c")
    with open(f"{shm_path}/c/manifest.json") as f:
        chunks = [item for item in json.load(f)["items"] if item["key"] == "big"]
    assert [(c["shape"][0], c["chunk_offsets"][0]) for c in chunks] == [(20, 0), (20, 20)]
    assert len({c["file"] for c in chunks}) == 2
    for loaded in (fresh, mapped, contiguous, strided):
        assert_same(state, loaded)


async def test_saving_without_checksums(shm_path: str) -> None:
    """`checksum=None` stores no digests; loads and `verify` have nothing to check."""
    state = {"w": torch.arange(1000.0)}
    async with Engine(checksum=None, **SMALL) as engine:
        await engine.save(state, f"{shm_path}/n")
        with open(f"{shm_path}/n/manifest.json") as f:
            manifest = json.load(f)
        assert manifest["checksum"] is None and manifest["items"][0]["checksum"] is None
        assert_same(state, await engine.load(f"{shm_path}/n"))
    with pytest.raises(ValueError, match=r"^checksum: expected one of \['None', 'xxh3_64'\], "
                                         r"found 'crc32'$"):
        Engine(checksum="crc32")


async def test_planning_runs_off_the_loop_thread(shm_path: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning (CPU-bound: DCP's planner ~20 us per tensor) runs on the engine's executor,
    never on the loop: `save()` itself reads nothing of the state dict."""
    from asynctron.engine import _save

    threads: list[str] = []
    real_file_plan = _save.file_plan

    def recording_file_plan(*args: object, **kwargs: object) -> object:
        threads.append(threading.current_thread().name)
        return real_file_plan(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_save, "file_plan", recording_file_plan)
    async with Engine(**SMALL) as engine:
        task = engine.save({"w": torch.ones(3)}, f"{shm_path}/p")
        assert threads == []  # nothing planned on the caller's thread
        await task
    assert len(threads) == 1 and threads[0].startswith("asynctron-io")


async def test_a_failed_save_nobody_awaited_is_raised_by_aclose(shm_path: str) -> None:
    """A trainer that only awaits `staged` still learns that a checkpoint failed: the failure
    is logged when it happens, and leaving the engine raises it."""
    from asynctron.testing import FaultyBackend

    loop = asyncio.get_running_loop()
    logged = asyncio.Event()

    class WhenLogged(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "save failed: StorageError" in record.getMessage():
                loop.call_soon_threadsafe(logged.set)

    handler = WhenLogged()
    logging.getLogger("asynctron").addHandler(handler)
    try:
        with pytest.raises(asynctron.StorageError, match=r"failed: ENOSPC"):
            async with Engine(backend=FaultyBackend(enospc_after_bytes=0), **SMALL) as engine:
                task = engine.save({"w": torch.ones(100_000)}, f"{shm_path}/s")
                with contextlib.suppress(asynctron.StorageError):
                    await task.staged
                await asyncio.wait_for(logged.wait(), 30)  # logged when it happens
                assert task.done() and task.failed() and not task.observed
    finally:
        logging.getLogger("asynctron").removeHandler(handler)


async def test_moving_latest_failing_after_the_commit_is_a_warning(shm_path: str) -> None:
    """The rename is the commit: a `latest` that cannot be replaced afterwards leaves a
    committed checkpoint, reported in `SaveResult.warnings`, not a failed save."""
    os.mkdir(f"{shm_path}/latest")  # a directory: replacing it with the pointer fails
    async with Engine(**SMALL) as engine:
        result = await engine.save({"w": torch.ones(3)}, f"{shm_path}/step_1")
        assert result.warnings and "`latest` was not moved" in result.warnings[0]
        assert_same({"w": torch.ones(3)}, await engine.load(f"{shm_path}/step_1"))


async def test_a_blocking_call_raising_stop_iteration_raises_instead_of_hanging() -> None:
    """asyncio refuses StopIteration on a future: the awaiter got a RuntimeError instead, and
    without it would wait for ever (a dataset's `__getitem__` raising it, for one)."""
    async with Engine(**SMALL) as engine:
        with pytest.raises(RuntimeError, match="raised StopIteration") as caught:
            await engine.run_blocking(next, iter(()))
    assert isinstance(caught.value.__cause__, StopIteration)
