"""What each fresh process of `asynctron bench data --source s3` runs: one method (megatron-core's
S3 reader by `ds[i]` or through torch's DataLoader; asynctron's GPTDataset served by
`AsyncLoader`, or by `ds[i]`) beside one trainer, the consumer's waits for batches timed and
the first samples digested; the names the bench reports the methods by, and `Job`, one run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

MiB = 1 << 20
GiB = 1 << 30
MEGATRON = "megatron S3 ds[i]"
DATALOADER = "megatron S3 DataLoader ({} workers)"
DATALOADER_WORKERS = (2, 4)
QUICK_DATALOADER_WORKERS = (2,)
"""A smoke run's (`--quick`): the 4-worker DataLoader runs the 2-worker's code."""
COLD = "asynctron S3 cold"
WARM = "asynctron S3 warm"
LOCAL = "asynctron local"
EPOCH = "asynctron S3 cold, whole epoch"
SUBSET = "asynctron S3 cold ds[i], 1% subset"
TRAINERS = ("idle", "busy")
QUICK_TRAINERS = ("idle",)
"""A smoke run's: beside a busy trainer a fresh process's imports alone take ~10 s."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """One run, in a fresh process."""

    method: str
    trainer: str
    """"idle" or "busy" (a thread busy in Python beside the consumer)."""
    prefix: str
    """The corpus: `s3://...` or a local path prefix."""
    index_cache: str
    """`path_to_cache`: the `.npy` indices (kept across runs)."""
    object_cache: str
    """`object_storage_cache_path` (S3 methods)."""
    sequence_length: int
    micro_batch_size: int
    num_samples: int
    """Samples to read (0: the epoch); megatron's runs stop at `limit_s` too."""
    limit_s: float
    num_verify: int
    prefetch_bytes: int


# in the fresh process: datasets ---------------------------------------------------------------

def _megatron_dataset(job: Job) -> Any:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    from asynctron.bench._corpus import BenchTokenizer, megatron_modules

    gpt = megatron_modules()[0]["gpt"]
    config = gpt.GPTDatasetConfig(
        random_seed=1234, sequence_length=job.sequence_length, tokenizer=BenchTokenizer(),
        blend=([job.prefix], None), split="1", path_to_cache=job.index_cache,
        object_storage_cache_path=job.object_cache, mmap_bin_files=False,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(gpt.GPTDataset, [None, None, None], lambda: True,
                                         config).build()[0]


def _asynctron_dataset(job: Job) -> Any:
    from asynctron.bench._corpus import BenchTokenizer
    from asynctron.datasets import GPTDatasetConfig, build_gpt_datasets

    remote = job.prefix.startswith("s3://")
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=job.sequence_length, tokenizer=BenchTokenizer(),
        blend=([job.prefix], None), split="1", path_to_cache=job.index_cache,
        create_attention_mask=False,
        **({"object_storage_cache_path": job.object_cache, "mmap_bin_files": False}
           if remote else {}))
    return build_gpt_datasets(config, [None, None, None])[0]


def _digest(tokens: Any, labels: Any) -> str:
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, np.int64).tobytes()
                                    + np.asarray(labels, np.int64).tobytes())


class _Batches:
    """Times the consumer's waits for batches and keeps the first samples' digests."""

    def __init__(self, num_verify: int) -> None:
        self.num_verify = num_verify
        self.digests: list[str] = []
        self.waits: list[float] = []
        self.num_samples = 0
        self.started = self._last = time.perf_counter()

    def took(self, batch: dict[str, Any]) -> None:
        """Count a batch (its wait ends now); digest its samples while some are missing."""
        self.waits.append(time.perf_counter() - self._last)
        size = len(batch["tokens"])
        for j in range(min(size, self.num_verify - len(self.digests))):
            self.digests.append(_digest(batch["tokens"][j], batch["labels"][j]))
        self.num_samples += size
        self._last = time.perf_counter()

    def elapsed_s(self) -> float:
        return self._last - self.started

    def result(self, sequence_length: int) -> dict[str, Any]:
        elapsed = self.elapsed_s()
        steady = sorted(self.waits[1:] or self.waits)
        return {"num_samples": self.num_samples, "elapsed_s": elapsed,
                "samples_per_s": self.num_samples / elapsed,
                "first_batch_s": self.waits[0], "wait_p50_s": steady[len(steady) // 2],
                "wait_p95_s": steady[min(len(steady) - 1, int(len(steady) * 0.95))],
                "wait_max_s": steady[-1], "digests": self.digests,
                "bytes_used": self.num_samples * (sequence_length + 1) * 2}


# in the fresh process: the methods ------------------------------------------------------------

def _read_one_by_one(dataset: Any, job: Job, batches: _Batches) -> None:
    """`ds[i]` in order, a micro batch at a time: `job.num_samples` of them (0: until the
    time limit, and at least the samples to verify)."""
    size = job.micro_batch_size
    for first in range(0, len(dataset) - size + 1, size):
        samples = [dataset[i] for i in range(first, first + size)]
        batches.took({key: [s[key] for s in samples] for key in ("tokens", "labels")})
        if job.num_samples:
            if batches.num_samples >= job.num_samples:
                return
        elif batches.elapsed_s() >= job.limit_s and batches.num_samples >= job.num_verify:
            return


def _read_dataloader(dataset: Any, job: Job, batches: _Batches) -> None:
    """torch's DataLoader over megatron's pretraining batches until the time limit, and at
    least the samples to verify."""
    import torch

    size = job.micro_batch_size
    workers = int(job.method.split("(")[1].split()[0])
    sampler = [list(range(i, i + size)) for i in range(0, len(dataset) - size + 1, size)]
    for batch in torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                             num_workers=workers):
        batches.took(batch)
        if batches.elapsed_s() >= job.limit_s and batches.num_samples >= job.num_verify:
            return


async def _read_loader(dataset: Any, job: Job, batches: _Batches) -> None:
    """asynctron's AsyncLoader, `job.num_samples` samples (0: the epoch)."""
    from asynctron import Engine
    from asynctron.datasets import AsyncLoader

    size = job.micro_batch_size
    count = min(job.num_samples or len(dataset), len(dataset)) // size * size
    async with Engine(num_workers=2) as engine, AsyncLoader(
            dataset, micro_batch_size=size, run_blocking=engine.run_blocking,
            prefetch_budget=job.prefetch_bytes, num_ready_batches=4) as loader:
        async for batch in loader:
            batches.took(batch)
            if batches.num_samples >= count:
                return


def cache_usage(cache_dir: str) -> dict[str, int]:
    from asynctron.datasets import object_cache_usage

    usage = object_cache_usage(cache_dir)
    return {"bytes_fetched": usage.bytes_fetched, "requests": usage.requests,
            "bytes_cached": usage.bytes_cached}


def run_one(job: Job) -> dict[str, Any]:
    """One method beside one trainer, in this (fresh) process."""
    import torch
    import uvloop

    from asynctron.bench._trainers import TrainerThread

    torch.set_num_threads(1)
    trainer = TrainerThread("python") if job.trainer == "busy" else None
    if trainer is not None:
        trainer.start()
    try:
        ours = not job.method.startswith("megatron")
        dataset = _asynctron_dataset(job) if ours else _megatron_dataset(job)
        on_store = ours and job.prefix.startswith("s3://")
        before = cache_usage(job.object_cache) if on_store else None
        batches = _Batches(job.num_verify)
        if job.method in (MEGATRON, SUBSET):
            _read_one_by_one(dataset, job, batches)
        elif not ours:
            _read_dataloader(dataset, job, batches)
        else:
            uvloop.run(_read_loader(dataset, job, batches))
    finally:
        if trainer is not None:
            trainer.stop()
    result = {**batches.result(job.sequence_length), "epoch_samples": len(dataset),
              "micro_batch_size": job.micro_batch_size}
    if before is not None:
        after = cache_usage(job.object_cache)
        result.update(bytes_fetched=after["bytes_fetched"] - before["bytes_fetched"],
                      requests=after["requests"] - before["requests"],
                      bytes_cached=after["bytes_cached"])
    return result
