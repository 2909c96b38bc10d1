"""AsyncLoader's worker processes: batches equal to `collate(ds[i] ...)` for every sample
option, batches the consumer keeps stay intact, and a failing, killed or orphaned worker is
reported or exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from asynctron import Engine
from asynctron.datasets import (
    AsyncLoader,
    ByteTokenizer,
    GPTDataset,
    GPTDatasetConfig,
    Split,
    collate,
)
from asynctron.datasets._builder import write_indexed_dataset
from asynctron.errors import LoaderWorkerError


def _padded_corpus(path: str, pad: int) -> Any:
    """Documents whose tokens include the pad id and the eod (0), so every masking rule
    fires."""
    rng = np.random.default_rng(11)
    documents = []
    for _ in range(120):
        tokens = rng.integers(2, 40, size=int(rng.integers(1, 90)))
        tokens[rng.random(tokens.size) < 0.05] = pad
        documents.append(np.append(tokens, 0))
    return write_indexed_dataset(path, documents, dtype=np.int32)


async def _all_batches(dataset: Any, micro_batch_size: int, **options: Any) -> list[dict]:
    async with Engine(num_workers=2) as engine, AsyncLoader(
            dataset, micro_batch_size=micro_batch_size, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 16, num_ready_batches=3, **options) as loader:
        return [batch async for batch in loader]


def _assert_equal_batches(found: list[dict], dataset: Any, micro_batch_size: int) -> None:
    assert len(found) == len(dataset) // micro_batch_size
    for step, batch in enumerate(found):
        first = step * micro_batch_size
        expected = collate([dataset[i] for i in range(first, first + micro_batch_size)])
        assert list(batch) == list(expected)
        for key in expected:
            assert batch[key].dtype == expected[key].dtype, key
            assert batch[key].shape == expected[key].shape, key
            assert torch.equal(batch[key], expected[key]), (step, key)


@pytest.mark.parametrize("options", [
    {},
    {"create_attention_mask": True},
    {"add_extra_token_to_sequence": False},
    {"eod_mask_loss": True},
    {"reset_position_ids": True, "reset_attention_mask": True, "create_attention_mask": True},
])
async def test_worker_batches_equal_collated_samples(tmp_path, tok, options) -> None:
    indexed = _padded_corpus(str(tmp_path / "padded"), tok.pad)
    config = GPTDatasetConfig(random_seed=3, sequence_length=24, tokenizer=tok,
                              path_to_cache=str(tmp_path / "cache"), **options)
    dataset = GPTDataset(indexed, None, np.arange(len(indexed), dtype=np.int32), 300,
                         Split.train, config)
    batches = await _all_batches(dataset, 4)  # kept, all of them: no slab is reused
    _assert_equal_batches(batches, dataset, 4)


async def test_the_blend_by_workers_and_in_process(blended) -> None:
    by_workers = await _all_batches(blended, 5)
    _assert_equal_batches(by_workers, blended, 5)
    in_process = await _all_batches(blended, 5, num_workers=0)
    assert len(in_process) == len(by_workers)
    for a, b in zip(by_workers, in_process, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


async def test_spawned_workers_reopen_the_dataset(make_corpus, tmp_path) -> None:
    """"spawn" pickles the dataset (its files are reopened in the worker)."""
    indexed = make_corpus("s", num_documents=80, eod=0)
    config = GPTDatasetConfig(random_seed=2, sequence_length=16, tokenizer=ByteTokenizer(),
                              path_to_cache=str(tmp_path / "cache"))
    dataset = GPTDataset(indexed, None, np.arange(len(indexed), dtype=np.int32), 120,
                         Split.train, config)
    batches = await _all_batches(dataset, 4, start_method="spawn", num_workers=1)
    _assert_equal_batches(batches, dataset, 4)


async def test_slabs_come_back_when_batches_are_dropped(gpt) -> None:
    async with Engine(num_workers=2) as engine, AsyncLoader(
            gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 16, num_ready_batches=2) as loader:
        kept = []
        async for batch in loader:
            if len(kept) < 10:
                kept.append(batch)  # held: their slabs must not be written again
        del batch
        slabs = loader._workers._slabs
        # the kept ones, the one in hand, the two asked for ahead, one coming back: no more
        assert slabs.num_used <= 10 + 1 + 2 + 1 < len(gpt) // 2
        assert slabs.num_lent == 10
    for step, batch in enumerate(kept):
        expected = collate([gpt[i] for i in range(2 * step, 2 * step + 2)])
        assert all(torch.equal(batch[k], expected[k]) for k in expected)


class _FailsAtSample6(GPTDataset):
    def locate_batch(self, ids: Any) -> Any:
        if 6 in list(ids):
            raise ValueError("sample 6 is unreadable")
        return super().locate_batch(ids)


async def test_a_worker_error_reaches_the_consumer_with_its_traceback(gpt) -> None:
    failing = _FailsAtSample6(gpt.dataset, gpt.dataset_path, gpt.indices, gpt.num_samples,
                              gpt.index_split, gpt.config)
    async with Engine(num_workers=2) as engine, AsyncLoader(
            failing, micro_batch_size=2, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 20, num_ready_batches=2, num_workers=1) as loader:
        seen = 0
        with pytest.raises(LoaderWorkerError) as raised:
            async for _ in loader:
                seen += 1
        assert seen == 3  # samples 0-5; the next batch holds sample 6
        assert raised.value.worker == 0 and raised.value.batch == 3
        message = str(raised.value)
        assert message.startswith("loader worker 0 failed on batch 3")
        assert "ValueError: sample 6 is unreadable" in message
        with pytest.raises(LoaderWorkerError):  # and stays failed
            await loader.__anext__()


async def test_a_killed_worker_is_reported_not_waited_for(gpt) -> None:
    async with Engine(num_workers=2) as engine, AsyncLoader(
            gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 16, num_ready_batches=2, num_workers=2) as loader:
        await loader.__anext__()
        os.kill(loader.worker_pids[1], signal.SIGKILL)
        with pytest.raises(LoaderWorkerError, match=r"^loader worker 1 \(pid \d+\) was killed "
                                                    r"by signal SIGKILL"):
            async with asyncio.timeout(30):
                async for _ in loader:
                    pass


def test_workers_exit_when_the_loaders_process_dies(gpt, tmp_path) -> None:
    """A trainer killed with SIGKILL leaves no worker behind (they check their parent)."""
    script = textwrap.dedent(f"""
        import asyncio, os, signal
        import numpy as np
        from asynctron import Engine
        from asynctron.datasets import (AsyncLoader, GPTDataset, GPTDatasetConfig,
                                        IndexedDataset, Split)
        class Tok:
            eod, pad, vocab_size, unique_identifiers = 0, 1001, 1002, {{"class": "Tok"}}
        indexed = IndexedDataset({gpt.dataset.path_prefix!r})
        config = GPTDatasetConfig(random_seed=1, sequence_length=32, tokenizer=Tok(),
                                  path_to_cache={str(tmp_path / "child-cache")!r})
        dataset = GPTDataset(indexed, None, np.arange(len(indexed), dtype=np.int32), None,
                             Split.train, config)
        async def main():
            async with Engine(num_workers=1) as engine, AsyncLoader(
                    dataset, micro_batch_size=2, run_blocking=engine.run_blocking,
                    prefetch_budget=1 << 16, num_ready_batches=2) as loader:
                await loader.__anext__()
                print(*loader.worker_pids, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_pinned_batches_copy_to_the_gpu_asynchronously(gpt) -> None:
    batches = await _all_batches(gpt, 4, pin_memory=True)
    assert all(batch["tokens"].is_pinned() for batch in batches)
    on_gpu = [batch["tokens"].to("cuda", non_blocking=True) for batch in batches]
    torch.cuda.synchronize()
    for found, batch in zip(on_gpu, batches, strict=True):
        assert torch.equal(found.cpu(), batch["tokens"])


async def test_workers_run_on_the_cpus_they_are_given(gpt) -> None:
    mine = sorted(os.sched_getaffinity(0))
    async with Engine(num_workers=1) as engine:
        async with AsyncLoader(gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
                               prefetch_budget=1 << 16, num_ready_batches=2,
                               worker_cpus=mine[-1:]) as loader:
            await loader.__anext__()
            assert all(os.sched_getaffinity(pid) == {mine[-1]} for pid in loader.worker_pids)
        with pytest.raises(ValueError, match=r"^worker_cpus: expected a non-empty subset of "
                                             r"this process's CPUs \[.*\], found \[100000\]$"):
            AsyncLoader(gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
                        prefetch_budget=1 << 16, num_ready_batches=2, worker_cpus=[100_000])
        with pytest.raises(ValueError, match=r"^worker_cpus: expected 'away', None or a set of "
                                             r"CPUs, found 'idle'$"):
            AsyncLoader(gpt, micro_batch_size=2, run_blocking=engine.run_blocking,
                        prefetch_budget=1 << 16, num_ready_batches=2, worker_cpus="idle")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
async def test_workers_keep_off_the_cpu_of_a_busy_thread_and_follow_it(gpt) -> None:
    mine = sorted(os.sched_getaffinity(0))
    where = {"cpu": mine[0]}
    stop = threading.Event()

    def busy() -> None:  # a trainer thread: a core's worth of work, wherever it is put
        while not stop.is_set():
            os.sched_setaffinity(0, {where["cpu"]})
            sum(range(10_000))  # holds the GIL; the loop still gets it every switch interval

    async def workers_avoid(cpu: int) -> None:
        expected = set(mine) - {cpu}
        deadline = time.monotonic() + 20
        while any(os.sched_getaffinity(pid) != expected for pid in loader.worker_pids):
            assert time.monotonic() < deadline, [os.sched_getaffinity(p)
                                                 for p in loader.worker_pids]
            await asyncio.sleep(0.1)

    thread = threading.Thread(target=busy, daemon=True)
    async with Engine(num_workers=1) as engine, AsyncLoader(
            gpt, micro_batch_size=2, run_blocking=engine.run_blocking, prefetch_budget=1 << 16,
            num_ready_batches=2) as loader:
        thread.start()
        try:
            await workers_avoid(mine[0])
            where["cpu"] = mine[-1]
            await workers_avoid(mine[-1])
        finally:
            stop.set()
            thread.join()
        assert isinstance(await loader.__anext__(), dict)

