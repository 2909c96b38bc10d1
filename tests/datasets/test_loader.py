"""AsyncLoader: megatron's sample order per rank, exact resume (also on another number of
ranks), the prefetch budget, and a loop that never blocks."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from asynctron import Engine
from asynctron.datasets import AsyncLoader, collate
from asynctron.engine import ByteBudget
from asynctron.testing import LoopWatchdog


async def _batches(dataset: Any, engine: Engine, *, micro_batch_size: int, rank: int = 0,
                   size: int = 1, state: dict[str, int] | None = None,
                   limit: int | None = None, budget: int = 1 << 20) -> tuple[list[dict], dict]:
    async with AsyncLoader(dataset, micro_batch_size=micro_batch_size,
                           run_blocking=engine.run_blocking, prefetch_budget=budget,
                           num_ready_batches=2, data_parallel_rank=rank,
                           data_parallel_size=size) as loader:
        if state is not None:
            loader.load_state_dict(state)
        batches = []
        async for batch in loader:
            batches.append(batch)
            if limit is not None and len(batches) == limit:
                break
        return batches, loader.state_dict()


def _expected(dataset: Any, ids: range) -> dict[str, Any]:
    return collate([dataset[i] for i in ids])


def _assert_batch(found: dict[str, Any], expected: dict[str, Any]) -> None:
    assert list(found) == list(expected)
    for key in expected:
        assert found[key].dtype == expected[key].dtype, key
        assert torch.equal(found[key], expected[key]), key


@pytest.mark.parametrize("which", ["gpt", "blended"])
async def test_each_rank_gets_megatrons_sampler_order(request, which: str) -> None:
    dataset = request.getfixturevalue(which)
    async with Engine(num_workers=2) as engine:
        for rank in range(2):
            batches, state = await _batches(dataset, engine, micro_batch_size=3, rank=rank,
                                            size=2)
            assert len(batches) == len(dataset) // 6
            for step, batch in enumerate(batches):
                first = step * 6 + rank * 3
                _assert_batch(batch, _expected(dataset, range(first, first + 3)))
            assert state["consumed_samples"] == len(batches) * 6


async def test_resume_is_exact_on_another_number_of_ranks(blended, tmp_path) -> None:
    """Global batch 8: 3 steps on 2 ranks x 4, saved in an asynctron checkpoint, then resumed on
    4 ranks x 2: the next global batches are the same samples."""
    async with Engine(num_workers=2) as engine:
        _, state = await _batches(blended, engine, micro_batch_size=4, rank=1, size=2, limit=3)
        assert state["consumed_samples"] == 24
        await engine.save({"loader": state, "model": torch.ones(3)}, tmp_path / "ckpt")
        restored = (await engine.load(tmp_path / "ckpt"))["loader"]
        assert restored == state
        per_rank = [await _batches(blended, engine, micro_batch_size=2, rank=r, size=4,
                                   state=restored, limit=2) for r in range(4)]
    for step in range(2):
        tokens = torch.cat([batches[step]["tokens"] for batches, _ in per_rank])
        start = 24 + step * 8
        assert torch.equal(tokens, _expected(blended, range(start, start + 8))["tokens"])
    assert all(state["consumed_samples"] == 40 for _, state in per_rank)


async def test_state_errors(gpt) -> None:
    async with Engine(num_workers=1) as engine:
        loader = AsyncLoader(gpt, micro_batch_size=4, run_blocking=engine.run_blocking,
                             prefetch_budget=1 << 16, num_ready_batches=1)
        good = loader.state_dict()
        with pytest.raises(ValueError, match=r"^loader state consumed_samples: expected a "
                                             r"multiple of micro_batch_size \* "
                                             r"data_parallel_size \(4\), found 6; resume at a "
                                             r"global-batch boundary$"):
            loader.load_state_dict({**good, "consumed_samples": 6})
        with pytest.raises(ValueError, match=r"^loader state dataset_length: expected \d+, "
                                             r"found 3; the state belongs to another dataset$"):
            loader.load_state_dict({**good, "dataset_length": 3})
        with pytest.raises(ValueError, match=r"^loader state version: expected 1, found 7"):
            loader.load_state_dict({**good, "version": 7})


async def test_prefetch_never_exceeds_its_budget(gpt) -> None:
    budget = ByteBudget(8 * 4096)  # a batch touches at most 2 samples x 2 parts x 2 pages
    async with Engine(num_workers=2) as engine:
        async with AsyncLoader(gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
                               prefetch_budget=budget, num_ready_batches=1) as loader:
            num_batches = 0
            async for _ in loader:
                num_batches += 1
                assert budget.borrowed_bytes <= budget.total_bytes
        stats = budget.statistics()
    assert num_batches == len(gpt) // 2
    assert 0 < stats.peak_borrowed_bytes <= budget.total_bytes
    assert stats.borrowed_bytes == 0


async def test_a_shared_budget_and_a_batch_larger_than_it(gpt) -> None:
    """A batch bigger than the whole budget is admitted alone, never deadlocks."""
    budget = ByteBudget(100)
    async with Engine(num_workers=2) as engine:
        batches, _ = await _batches(gpt, engine, micro_batch_size=4, limit=5, budget=100)
        async with AsyncLoader(gpt, micro_batch_size=4, run_blocking=engine.run_blocking,
                               prefetch_budget=budget, num_ready_batches=1) as loader:
            async for _ in loader:
                pass
    assert len(batches) == 5 and budget.statistics().borrowed_bytes == 0


async def test_the_loop_never_blocks(blended) -> None:
    async with Engine(num_workers=2) as engine, LoopWatchdog() as dog:
        batches, _ = await _batches(blended, engine, micro_batch_size=8)
    assert batches
    assert dog.report().worst_delay_s < 0.5, dog.report()


async def test_every_batch_gives_the_loop_a_turn_even_when_ready() -> None:
    """A trainer whose batches are always ready still lets the loop run once a step (saves in
    flight go on): before, steps ran back to back and the demo's loop stalled for several."""
    turns = 0

    def count() -> None:
        nonlocal turns
        turns += 1

    data = [{"x": torch.tensor([i])} for i in range(10)]
    async with Engine(num_workers=1) as engine, AsyncLoader(
            data, micro_batch_size=1, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 20, num_ready_batches=8) as loader:
        batches = aiter(loader)
        await anext(batches)
        await asyncio.wait(list(loader._pending))  # every next batch ready before asked for
        for _ in range(3):
            before = turns
            asyncio.get_running_loop().call_soon(count)
            await anext(batches)
            assert turns == before + 1


async def test_plain_datasets_are_read_without_prefetch() -> None:
    data = [{"x": torch.tensor([i])} for i in range(10)]
    async with Engine(num_workers=1) as engine:
        batches, _ = await _batches(data, engine, micro_batch_size=5)
    assert [b["x"].tolist() for b in batches] == [[[0], [1], [2], [3], [4]],
                                                   [[5], [6], [7], [8], [9]]]


async def test_a_failing_sample_reaches_the_consumer() -> None:
    class Broken:
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if i == 5:
                raise KeyError(f"sample {i}")
            return {"x": torch.tensor(i)}

    async with Engine(num_workers=1) as engine, AsyncLoader(
            Broken(), micro_batch_size=2, run_blocking=engine.run_blocking,
            prefetch_budget=4096, num_ready_batches=1) as loader:
        seen = []
        with pytest.raises(KeyError, match="sample 5"):
            async for batch in loader:
                seen.append(batch["x"].tolist())
        assert seen == [[0, 1], [2, 3]]
        with pytest.raises(KeyError):  # and stays failed
            await loader.__anext__()


async def test_misuse_and_bad_arguments(gpt) -> None:
    async with Engine(num_workers=1) as engine:
        loader = AsyncLoader(gpt, micro_batch_size=1, run_blocking=engine.run_blocking,
                             prefetch_budget=4096, num_ready_batches=1)
        with pytest.raises(RuntimeError, match=r"^loader: iterate inside `async with"):
            await loader.__anext__()
        for name, value, message in (
                ("micro_batch_size", 0, r"^micro_batch_size: expected an int >= 1, found 0$"),
                ("num_ready_batches", 0, r"^num_ready_batches: expected an int >= 1, found 0$"),
                ("data_parallel_rank", 2, r"^data_parallel_rank: expected < data_parallel_size "
                                          r"\(2\), found 2$")):
            kwargs: dict[str, Any] = {"micro_batch_size": 1, "num_ready_batches": 1,
                                      "data_parallel_size": 2, name: value}
            with pytest.raises(ValueError, match=message):
                AsyncLoader(gpt, run_blocking=engine.run_blocking, prefetch_budget=4096,
                            **kwargs)


def test_collate_expands_a_shared_mask() -> None:
    mask = torch.ones(1, 4, 4, dtype=torch.bool)
    batch = collate([{"m": mask, "t": torch.tensor([1]), "d": np.int16(2)},
                     {"m": mask, "t": torch.tensor([2]), "d": np.int16(3)}])
    assert batch["m"].shape == (2, 1, 4, 4) and batch["m"].data_ptr() == mask.data_ptr()
    assert batch["t"].tolist() == [[1], [2]]
    assert batch["d"].dtype == torch.int16 and batch["d"].tolist() == [2, 3]


async def test_loader_runs_on_uvloop() -> None:
    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
