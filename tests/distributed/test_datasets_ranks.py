"""Datasets on real gloo ranks: rank 0 builds the cached indices while the others wait, then
each rank's AsyncLoader serves its share of every global batch."""

from __future__ import annotations

import os

import numpy as np
import pytest

from asynctron._launch import run_local_ranks

WORLD_SIZE = 2


def _rank_main(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    import uvloop

    from asynctron import Engine
    from asynctron.datasets import AsyncLoader, GPTDatasetConfig, build_gpt_datasets

    config = GPTDatasetConfig(random_seed=11, sequence_length=16, eod_id=0,
                              blend=([f"{root}/a", f"{root}/b"], [1.0, 1.0]), split="1",
                              path_to_cache=f"{root}/cache")
    train = build_gpt_datasets(config, [64, 0, 0])[0]

    async def read() -> list[list[int]]:
        async with Engine(num_workers=2) as engine, AsyncLoader(
                train, micro_batch_size=2, run_blocking=engine.run_blocking,
                prefetch_budget=1 << 20, num_ready_batches=2, data_parallel_rank=rank,
                data_parallel_size=WORLD_SIZE) as loader:
            return [batch["tokens"][:, 0].tolist() async for batch in loader]

    firsts = uvloop.run(read())
    expected = [[int(train[s * 4 + rank * 2 + k]["tokens"][0]) for k in range(2)]
                for s in range(len(train) // 4)]
    gathered: list[object] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, firsts == expected)
    dist.barrier()
    return {"ok": all(gathered), "batches": len(firsts),
            "files": sorted(os.listdir(f"{root}/cache"))}


@pytest.mark.slow
def test_two_ranks_share_the_cache_and_split_each_batch(tmp_path) -> None:
    from asynctron.datasets.formats._builder import write_indexed_dataset

    rng = np.random.default_rng(0)
    for name in "ab":
        write_indexed_dataset(str(tmp_path / name),
                              [rng.integers(1, 500, int(rng.integers(5, 80))) for _ in range(60)],
                              dtype=np.uint16)
    results = [r.unwrap() for r in run_local_ranks(_rank_main, WORLD_SIZE, str(tmp_path),
                                                   timeout_s=180)]
    assert all(r["ok"] for r in results)
    assert results[0]["batches"] == results[1]["batches"] == 16
    # one GPTDataset entry per corpus and one BlendedDataset entry, 4 + 4 + 3 files, built once
    assert len(results[0]["files"]) == 11 and results[0]["files"] == results[1]["files"]


def _failing_rank_main(rank: int, world_size: int, root: str) -> str:
    from asynctron.datasets import GPTDatasetConfig, build_gpt_datasets
    from asynctron.datasets.formats._gpt import GPTDataset

    def broken(self: GPTDataset) -> None:
        raise OSError(28, "No space left on device (injected)")

    if rank == 0:
        GPTDataset._build_indices = broken  # type: ignore[method-assign]
    config = GPTDatasetConfig(random_seed=11, sequence_length=16, eod_id=0,
                              blend=([f"{root}/a"], None), split="1",
                              path_to_cache=f"{root}/cache")
    try:
        build_gpt_datasets(config, [None, None, None])
        return "built"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.slow
def test_a_failed_build_on_rank_0_fails_every_rank_without_hanging(tmp_path) -> None:
    from asynctron.datasets.formats._builder import write_indexed_dataset

    write_indexed_dataset(str(tmp_path / "a"), [np.arange(1, 50)] * 20, dtype=np.uint16)
    outcomes = [r.unwrap() for r in run_local_ranks(_failing_rank_main, WORLD_SIZE,
                                                    str(tmp_path), timeout_s=180)]
    assert outcomes[0].startswith("OSError: [Errno 28]")
    assert outcomes[1].startswith("PeerError: building datasets: rank 0 failed (OSError: "
                                  "[Errno 28] No space left on device (injected)); see its error")
