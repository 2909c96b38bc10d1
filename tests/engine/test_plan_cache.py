"""Plan cache (seed 002): an unchanged structure reuses its plan; new values are still saved."""

from __future__ import annotations

import pytest
import torch

from asynctron import Engine
from asynctron.engine._plan_cache import PlanCache
from tests.conftest import assert_same

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


def _state(step: int, rows: int = 100) -> dict:
    return {"model": {"w": torch.full((rows, 300), float(step)), "b": torch.arange(7) * step},
            "rng": bytes([step]) * 16, "step": step, "lr": 0.1 / step}


async def test_same_structure_hits_and_saves_the_new_values(shm_path: str) -> None:
    async with Engine(**SMALL) as engine:
        await engine.save(_state(1), f"{shm_path}/step_1")
        await engine.save(_state(2), f"{shm_path}/step_2")
        assert engine.plan_cache.statistics().num_hits == 1
        assert_same(_state(1), await engine.load(f"{shm_path}/step_1"))
        assert_same(_state(2), await engine.load(f"{shm_path}/step_2"))


@pytest.mark.parametrize(
    "changed",
    [
        _state(3, rows=101),  # a shape
        {**_state(3), "rng": b"longer" * 10},  # a bytes length
        {**_state(3), "extra": torch.zeros(1)},  # a new key
        {**_state(3), "model": {"w": torch.zeros(100, 300, dtype=torch.float16),
                                "b": torch.arange(7)}},  # a dtype
    ],
)
async def test_changed_structure_misses(shm_path: str, changed: dict) -> None:
    async with Engine(**SMALL) as engine:
        await engine.save(_state(1), f"{shm_path}/a")
        await engine.save(changed, f"{shm_path}/b")
        assert engine.plan_cache.statistics().num_hits == 0
        assert_same(changed, await engine.load(f"{shm_path}/b"))


def test_cache_keeps_the_most_recently_used_plans() -> None:
    cache = PlanCache(max_entries=2)
    for key in ("a", "b", "a", "c"):
        hit = key in cache.snapshot()
        cache.record_use(key, hit=hit)
        if not hit:
            cache.store(key, object())  # type: ignore[arg-type]
    assert set(cache.snapshot()) == {"a", "c"}
    assert cache.statistics().num_hits == 1 and cache.statistics().num_misses == 3
    assert "2/2 plans" in repr(cache)
