"""Tiers on one process (one node, no replicas): saves by step into the local tier, retention
by complete steps, drains to a store (a shared path here; S3 in tests/s3), restores from the
nearest tier that verifies, and every misuse refused."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
from typing import Any

import pytest
import torch

import asynctron
from asynctron import (
    BackgroundEngine,
    CheckpointNotFoundError,
    Engine,
    StorageError,
    Tiers,
)
from asynctron.cli import verify_checkpoint
from asynctron.storage import LocalBackend
from asynctron.storage.backends.local import LocalCheckpoints
from asynctron.testing import FaultyBackend
from tests.conftest import assert_same

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(50_000, generator=g), "b": torch.arange(step, step + 7)},
            "rng": torch.get_rng_state(), "loader": {"consumed_samples": 8 * step},
            "step": step}


def _empty() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(50_000), "b": torch.zeros(7, dtype=torch.long)},
            "rng": torch.zeros_like(torch.get_rng_state()), "loader": {"consumed_samples": 0},
            "step": -1}


def _tiers(tmp_path: Any, **fields: Any) -> Tiers:
    return Tiers(**{"local": f"{tmp_path}/local", "replicas": 0, **fields})


def _restored(result: asynctron.RestoreResult, target: dict[str, Any], step: int) -> None:
    """`target` holds `step`'s tensors and `result.state` its values, bit for bit."""
    expected = _state(step)
    assert result.step == step
    assert_same(expected["model"], target["model"])
    assert torch.equal(expected["rng"], target["rng"])
    assert result.state["step"] == step and result.state["loader"] == expected["loader"]


async def _load(path: str) -> dict[str, Any]:
    async with Engine(**SMALL) as engine:
        return await engine.load(path)


async def _save_steps(tiers: Tiers, steps: range, **options: Any) -> list[asynctron.SaveResult]:
    async with Engine(tiers=tiers, **SMALL, **options) as engine:
        return [await engine.save(_state(step), step=step) for step in steps]


async def test_a_step_saved_to_the_local_tier_restores_bit_for_bit(tmp_path: Any) -> None:
    tiers = _tiers(tmp_path)
    results = await _save_steps(tiers, range(1, 4))
    assert [r.step for r in results] == [1, 2, 3]
    assert results[-1].path == f"{tmp_path}/local/step_00000003.rank_00000.of_00001"
    assert all(name.startswith("__0_") for name in results[-1].files)
    target = _empty()
    async with Engine(tiers=tiers, **SMALL) as engine:
        result = await engine.restore(target)
    _restored(result, target, 3)
    assert (result.source, result.sources, result.skipped) == ("local", ("local",), ())
    with pytest.raises(ValueError, match=r"rank 0's shard of a step saved to tiers .* restore"):
        await _load(results[-1].path)  # a shard is not a checkpoint of its own


async def test_the_local_tier_keeps_its_newest_complete_steps(tmp_path: Any) -> None:
    await _save_steps(_tiers(tmp_path, keep_local=2), range(1, 6))
    assert sorted(os.listdir(f"{tmp_path}/local")) == [
        "step_00000004.rank_00000.of_00001", "step_00000005.rank_00000.of_00001"]


async def test_a_failed_save_prunes_nothing_and_the_last_complete_step_restores(
        tmp_path: Any) -> None:
    tiers = _tiers(tmp_path, keep_local=1)
    await _save_steps(tiers, range(1, 3))
    failing = FaultyBackend(enospc_after_bytes=100_000)
    async with Engine(tiers=tiers, backend=failing, **SMALL) as engine:
        with pytest.raises(StorageError, match="ENOSPC"):
            await engine.save(_state(3), step=3)
    assert sorted(os.listdir(f"{tmp_path}/local")) == ["step_00000002.rank_00000.of_00001"]
    target = _empty()
    async with Engine(tiers=tiers, **SMALL) as engine:
        _restored(await engine.restore(target), target, 2)


async def test_every_store_every_th_step_is_drained_as_an_ordinary_checkpoint(
        tmp_path: Any) -> None:
    store = f"{tmp_path}/store"
    await _save_steps(_tiers(tmp_path, store=store, store_every=2, keep_store=2), range(1, 8))
    assert sorted(os.listdir(store)) == [".asynctron-ledger", "latest", "step_00000004",
                                         "step_00000006"]
    loaded = await _load(store)  # follows latest: an ordinary checkpoint
    assert_same(_state(6)["model"], loaded["model"])
    assert loaded["step"] == 6
    assert "rank_00000.manifest.json" in os.listdir(f"{store}/step_00000006")
    path, manifest, failures = await verify_checkpoint(store)
    assert path == f"{store}/step_00000006" and failures == [] and manifest.items


@pytest.mark.parametrize("damage", ["deleted", "flipped", "truncated"])
async def test_a_missing_or_damaged_local_shard_is_skipped_and_the_store_serves(
        tmp_path: Any, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    tiers = _tiers(tmp_path, store=f"{tmp_path}/store", store_every=1)
    results = await _save_steps(tiers, range(1, 3))
    shard = results[-1].path
    data = os.path.join(shard, results[-1].files[0])
    if damage == "deleted":
        for name in os.listdir(f"{tmp_path}/local"):
            os.rename(f"{tmp_path}/local/{name}", f"{tmp_path}/lost-{name}")
    elif damage == "flipped":
        with open(data, "r+b") as f:
            f.seek(1000)
            byte = f.read(1)[0]
            f.seek(1000)
            f.write(bytes([byte ^ 0x10]))
    else:
        os.truncate(data, 4096)
    target = _empty()
    with caplog.at_level(logging.WARNING, logger="asynctron.engine.tiers"):
        async with Engine(tiers=tiers, **SMALL) as engine:
            result = await engine.restore(target)
    _restored(result, target, 2)
    assert result.source == "store"
    if damage != "deleted":
        assert len(result.skipped) == 1 and shard in result.skipped[0]
        assert ("expected xxh3_64" if damage == "flipped" else "bytes") in result.skipped[0]
        assert "restore: rank 0: skipping local tier" in caplog.text and shard in caplog.text


async def test_a_first_start_is_its_own_outcome(tmp_path: Any) -> None:
    """Nothing in any tier and a store that answered so: `step` None, the state untouched."""
    tiers = _tiers(tmp_path, store=f"{tmp_path}/store")
    target = _state(0)
    async with Engine(tiers=tiers, **SMALL) as engine:
        result = await engine.restore(target)
    assert (result.step, result.source, result.sources) == (None, None, (None,))
    assert_same(_state(0)["model"], target["model"]) and result.state["step"] == 0


async def test_steps_saved_but_none_whole_is_an_error_naming_what_each_tier_held(
        tmp_path: Any) -> None:
    tiers = _tiers(tmp_path, store=f"{tmp_path}/store", store_every=100)
    results = await _save_steps(tiers, range(1, 2))
    os.truncate(os.path.join(results[0].path, results[0].files[0]), 10)
    async with Engine(tiers=tiers, **SMALL) as engine:
        with pytest.raises(CheckpointNotFoundError, match=r"restore: expected a step that the "
                                                          r"tiers hold whole for all 1 ranks, .*"
                                                          r"node 0: step 1 rank 0/1; the store "
                                                          r"held: nothing"):
            await engine.restore(_empty())


class _UnlistableStore(LocalBackend):
    """A store whose listing fails as an unreachable one's does (on an object store, the
    same case runs against a stopped server: tests/objects)."""

    def checkpoints(self, run_blocking: Any) -> LocalCheckpoints:
        class Unlistable(LocalCheckpoints):
            async def list_checkpoints(self, root: str) -> list[str]:
                raise StorageError(f"listing {root} failed: ETIMEDOUT (injected)", path=root,
                                   errno=errno.ETIMEDOUT)

        return Unlistable(self.file_io, self._live, run_blocking)


async def test_a_store_that_does_not_answer_is_never_taken_for_a_first_start(
        tmp_path: Any) -> None:
    """With the local tier gone and the store unlistable, restore raises a store error that
    names the store, not `CheckpointNotFoundError` (which a trainer may take for a first
    start)."""
    tiers = _tiers(tmp_path, store=f"{tmp_path}/store")
    await _save_steps(tiers, range(1, 3))
    shutil.rmtree(f"{tmp_path}/local")
    async with Engine(tiers=tiers, store_backend=_UnlistableStore(), **SMALL) as engine:
        with pytest.raises(StorageError, match=r"restore: expected the store .*store to "
                                               r"answer, found .*ETIMEDOUT.*not a first "
                                               r"start") as raised:
            await engine.restore(_empty())
    assert not isinstance(raised.value, CheckpointNotFoundError)


async def test_a_state_that_does_not_match_fails_the_restore_not_a_tier(tmp_path: Any) -> None:
    tiers = _tiers(tmp_path)
    await _save_steps(tiers, range(1, 2))
    async with Engine(tiers=tiers, **SMALL) as engine:
        with pytest.raises(ValueError, match=r"model\.w"):
            await engine.restore({"model": {"w": torch.zeros(3)}})


async def test_a_step_restored_is_saved_again_and_newer_ones_are_forgotten(
        tmp_path: Any) -> None:
    tiers = _tiers(tmp_path, keep_local=5)
    await _save_steps(tiers, range(1, 5))
    target = _empty()
    async with Engine(tiers=tiers, **SMALL) as engine:
        _restored(await engine.restore(target, step=2), target, 2)
        assert sorted(os.listdir(f"{tmp_path}/local")) == [
            "step_00000001.rank_00000.of_00001",
            "step_00000002.rank_00000.of_00001"]  # 3, 4: another life's
        await engine.save(_state(2), step=2)  # the restored step again: replaced
        await engine.save(_state(3), step=3)
    async with Engine(tiers=tiers, **SMALL) as engine:
        _restored(await engine.restore(target), target, 3)


async def test_misuse_is_refused_at_the_call(tmp_path: Any) -> None:
    async with Engine(**SMALL) as engine:
        with pytest.raises(ValueError, match=r"save step=1: expected an engine with tiers"):
            engine.save({}, step=1)
        with pytest.raises(ValueError, match=r"restore: expected an engine with tiers"):
            await engine.restore({})
        with pytest.raises(ValueError, match=r"save: expected a path .* found neither"):
            engine.save({})
    async with Engine(tiers=_tiers(tmp_path), **SMALL) as engine:
        with pytest.raises(ValueError, match=r"save: expected a path or step=, found both"):
            engine.save({}, f"{tmp_path}/x", step=1)
        with pytest.raises(ValueError, match=r"expected format='asynctron' and snapshot=True"):
            engine.save({}, step=1, format="dcp")
        with pytest.raises(ValueError, match=r"step: expected an int >= 0, found -1"):
            engine.save({}, step=-1)
    async with Engine(tiers=Tiers(local=f"{tmp_path}/l", replicas=1)) as engine:
        await engine.save(_state(1), step=1)  # one node: no replicas (a warning says so)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(StorageError, match=r"Tiers\.local .*a-file/tier: expected a directory "
                                           r"this node can write .* checked when the engine "
                                           r"starts"):
        async with Engine(tiers=Tiers(local=f"{tmp_path}/a-file/tier")):
            pass  # found at the start, not at the first save


async def test_closing_the_engine_waits_for_the_drain(tmp_path: Any) -> None:
    """Invariant: `aclose` returns only once the drain in flight has committed the step to
    the store (what the store holds is recorded the moment `aclose` returns)."""
    store = FaultyBackend()
    gate = store.hold("commit", where="step_00000001")
    tiers = _tiers(tmp_path, store=f"{tmp_path}/store", store_every=1)
    seen_at_close: list[list[str]] = []
    async with Engine(tiers=tiers, store_backend=store, **SMALL) as engine:
        await engine.save(_state(1), step=1)  # committed locally; the drain holds
        await gate.reached()
        closing_began = asyncio.Event()

        async def close() -> None:
            closing_began.set()
            await engine.aclose()  # runs to its first wait before this task yields
            seen_at_close.append(sorted(os.listdir(f"{tmp_path}/store")))

        closing = asyncio.ensure_future(close())
        await closing_began.wait()
        assert not closing.done()  # held at the store's commit: it cannot have returned
        gate.release()
        await closing
    assert seen_at_close == [["latest", "step_00000001"]]
    assert_same(_state(1)["model"], (await _load(f"{tmp_path}/store"))["model"])


async def test_a_cancelled_save_leaves_the_previous_step(tmp_path: Any) -> None:
    tiers = _tiers(tmp_path)
    backend = FaultyBackend()
    async with Engine(tiers=tiers, backend=backend, **SMALL) as engine:
        await engine.save(_state(1), step=1)
        gate = backend.hold("write", where="step_00000002")
        task = engine.save(_state(2), step=2)
        await gate.reached()
        task.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert os.listdir(f"{tmp_path}/local") == ["step_00000001.rank_00000.of_00001"]
    target = _empty()
    async with Engine(tiers=tiers, **SMALL) as engine:
        _restored(await engine.restore(target), target, 1)


def test_the_background_engine_saves_and_restores_by_step(tmp_path: Any) -> None:
    tiers = _tiers(tmp_path)
    with BackgroundEngine(tiers=tiers, **SMALL) as engine:
        assert engine.save(_state(5), step=5).result().step == 5
    target = _empty()
    with BackgroundEngine(tiers=tiers, **SMALL) as engine:
        _restored(engine.restore(target), target, 5)
