"""Staging memory: slabs outlive engines in the process-wide cache, within its trim bound."""

from __future__ import annotations

import pytest
import torch

import asynctron
from asynctron import Engine
from asynctron.engine import ByteBudget, staging_statistics
from asynctron.engine._slabs import SlabCache, SlabPool

SLAB = 1 << 20
SMALL = {"slab_bytes": SLAB, "memory_budget_bytes": 4 * SLAB}


def _state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((SLAB // 4,), float(i)) for i in range(3)}


async def test_a_second_engine_reuses_the_first_engines_slabs(shm_path: str) -> None:
    """A fresh Engine (a script's save) copies into warm pages: the slabs of the engine before
    it, not new ones."""
    asynctron.free_idle_staging()
    async with Engine(**SMALL) as engine:
        await engine.save(_state(), f"{shm_path}/a")
    first = staging_statistics()
    assert first.idle_bytes >= 3 * SLAB  # kept, though the engine is closed
    async with Engine(**SMALL) as engine:
        await engine.save(_state(), f"{shm_path}/b")
    second = staging_statistics()
    assert second.num_allocated == first.num_allocated
    assert second.num_reused >= first.num_reused + 3
    assert asynctron.free_idle_staging() == second.idle_bytes
    assert staging_statistics().idle_bytes == 0


async def test_prefault_makes_the_first_save_allocate_nothing(shm_path: str) -> None:
    asynctron.free_idle_staging()
    async with Engine(**SMALL) as engine:
        assert await engine.prefault_staging() == 4 * SLAB  # the whole budget
        assert await engine.prefault_staging(SLAB + 1) == 2 * SLAB  # whole slabs
        before = staging_statistics()
        await engine.save(_state(), f"{shm_path}/a")
        assert staging_statistics().num_allocated == before.num_allocated
        assert engine.budget.borrowed_bytes == 0
        with pytest.raises(ValueError, match=r"^nbytes: expected None or an int >= 0, found -1$"):
            await engine.prefault_staging(-1)


def test_the_cache_keeps_idle_slabs_up_to_the_largest_budget_seen() -> None:
    cache = SlabCache()
    cache.admit(2 * SLAB)
    slabs = [cache.allocate(SLAB, pinned=False) for _ in range(3)]
    for slab in slabs:
        cache.give(slab)
    assert cache.statistics().idle_bytes == 2 * SLAB  # the third is freed on release
    assert cache.take(SLAB, pinned=False) is not None
    assert cache.take(2 * SLAB, pinned=False) is None  # another size: a miss
    assert cache.trim() == SLAB and cache.statistics().idle_bytes == 0


def test_one_call_save_writes_in_place_without_staging(shm_path: str) -> None:
    """`asynctron.save` waits for the commit anyway: contiguous CPU tensors are written from
    their own memory, no slab is borrowed."""
    before = staging_statistics()
    result = asynctron.save(_state(), f"{shm_path}/one")
    after = staging_statistics()
    assert result.nbytes == 3 * SLAB
    assert (after.num_allocated, after.num_reused) == (before.num_allocated, before.num_reused)
    loaded = asynctron.load(f"{shm_path}/one")
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())


async def test_on_a_device_saves_without_a_snapshot_stage_only_into_warm_slabs(
        tmp_path: object) -> None:
    """On a disk, O_DIRECT from warm aligned slabs beats buffered writes from the caller's
    memory, but touching fresh slabs costs more than it gains: a save without a snapshot is
    staged only when the cache holds warm slabs for it, else written in place."""
    from asynctron.storage.node_files._sysio import filesystem_type

    assert filesystem_type("/proc/self") == "proc"
    if filesystem_type(str(tmp_path)) in ("tmpfs", "ramfs", None):
        pytest.skip("the temporary directory is not on a device")
    asynctron.free_idle_staging()
    async with Engine(**SMALL) as engine:
        before = staging_statistics()
        await engine.save(_state(), f"{tmp_path}/cold", snapshot=False)
        cold = staging_statistics()
        assert (cold.num_allocated, cold.num_reused) == (before.num_allocated,
                                                         before.num_reused)
        assert await engine.prefault_staging(3 * SLAB) == 3 * SLAB
        warm = staging_statistics()
        await engine.save(_state(), f"{tmp_path}/warm", snapshot=False)
        after = staging_statistics()
        assert after.num_reused > warm.num_reused and after.num_allocated == warm.num_allocated
        for name in ("cold", "warm"):
            loaded = await engine.load(f"{tmp_path}/{name}")
            assert all(torch.equal(loaded[k], v) for k, v in _state().items())


def test_slabs_are_pinned_once_the_process_uses_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """pin_memory=None pins only once CUDA is in use (a CPU-only trainer on a GPU machine
    never starts a CUDA context through its saves); an explicit choice stands."""
    in_use = False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: in_use)
    budget = ByteBudget(4 * SLAB)

    async def never(*_: object) -> None:
        raise AssertionError("not called")

    auto = SlabPool(budget, SLAB, None, never)
    fixed = SlabPool(budget, SLAB, False, never)
    assert not auto.pinned and not fixed.pinned
    in_use = True
    assert auto.pinned and not fixed.pinned
