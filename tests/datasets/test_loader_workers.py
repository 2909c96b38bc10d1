"""AsyncLoader's worker processes: batches equal to `collate(ds[i] ...)` for every sample
option, batches the consumer keeps stay intact, a worker's error reaches the consumer as itself
(or, where it cannot, as LoaderWorkerError naming it), and a killed or orphaned worker is
reported or exits."""

from __future__ import annotations

import asyncio
import os
import re
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
from asynctron.datasets.formats._builder import write_indexed_dataset
from asynctron.datasets.loader import _workers
from asynctron.errors import CorruptDatasetError, LoaderWorkerError


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
    """Raises `error` (ValueError unless set) for the batch that holds sample 6."""

    error: Exception = ValueError("sample 6 is unreadable")

    def locate_batch(self, ids: Any) -> Any:
        if 6 in list(ids):
            raise self.error
        return super().locate_batch(ids)


async def _fail_at_sample_6(gpt: GPTDataset, error: Exception | None = None) -> BaseException:
    """What a loader with one worker raises at the batch that holds sample 6 (samples 0-5
    arrive first), checked to stay raised."""
    failing = _FailsAtSample6(gpt.dataset, gpt.dataset_path, gpt.indices, gpt.num_samples,
                              gpt.index_split, gpt.config)
    if error is not None:
        failing.error = error
    async with Engine(num_workers=2) as engine, AsyncLoader(
            failing, micro_batch_size=2, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 20, num_ready_batches=2, num_workers=1) as loader:
        seen = 0
        with pytest.raises(Exception) as raised:
            async for _ in loader:
                seen += 1
        assert seen == 3  # samples 0-5; the next batch holds sample 6
        with pytest.raises(type(raised.value)) as again:  # and stays failed
            await loader.__anext__()
        assert again.value is raised.value
    return raised.value


def _remote_traceback(error: BaseException) -> str:
    cause = error.__cause__
    assert type(cause).__name__ == "_RemoteTraceback", repr(cause)
    return str(cause)


async def test_a_worker_error_reaches_the_consumer_as_itself_with_its_traceback(gpt) -> None:
    error = await _fail_at_sample_6(gpt)
    assert type(error) is ValueError
    assert str(error) == "sample 6 is unreadable"
    assert error.__notes__ == ["raised by loader worker 0 on batch 3 (samples from 0 + 3 steps)"]
    remote = _remote_traceback(error)
    assert "in locate_batch" in remote
    assert remote.endswith('ValueError: sample 6 is unreadable\n"""')


async def test_a_corrupt_dataset_error_in_a_worker_keeps_its_type_message_and_path(gpt) -> None:
    corrupt = CorruptDatasetError("corpus.bin: expected 4096 bytes, found 12; rebuild it",
                                  path="/data/corpus.bin", offset=4096)
    error = await _fail_at_sample_6(gpt, corrupt)
    assert type(error) is CorruptDatasetError
    assert str(error) == "corpus.bin: expected 4096 bytes, found 12; rebuild it"
    assert (error.path, error.offset) == ("/data/corpus.bin", 4096)
    assert "CorruptDatasetError: corpus.bin: expected 4096" in _remote_traceback(error)


async def test_an_index_error_in_a_worker_arrives_as_index_error(gpt) -> None:
    error = await _fail_at_sample_6(gpt, IndexError("sample 6 out of range"))
    assert type(error) is IndexError and error.args == ("sample 6 out of range",)


class _Unpicklable(Exception):
    """Holds a lock: it does not pickle."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class _NotUnpicklable(Exception):
    """Pickles, but its one message arg does not rebuild it (two are required)."""

    def __init__(self, sample: int, why: str) -> None:
        super().__init__(f"sample {sample}: {why}")


@pytest.mark.parametrize(("error", "described", "why"), [
    (_Unpicklable("sample 6 is locked"), r"[\w.]*_Unpicklable: sample 6 is locked",
     r"it does not pickle \(TypeError: cannot pickle '_thread.lock' object\); make the "
     r"exception picklable"),
    (_NotUnpicklable(6, "torn"), r"[\w.]*_NotUnpicklable: sample 6: torn",
     r"it does not unpickle here \(TypeError: .*missing 1 required positional argument: "
     r"'why'\); make the exception unpickle to itself \(its args rebuild it, or give it a "
     r"`__reduce__`\)"),
    (ValueError("x" * 5000), r"ValueError: x{470,}\.\.\.",
     r"its pickle is \d+ bytes, over the \d+ a worker's report has room for; keep large "
     r"values out of the exception"),
    (StopIteration("no sample 6"), r"StopIteration: no sample 6",
     r"raised as itself it would end the consumer's `async for`"),
], ids=["unpicklable", "not-unpicklable", "too-large", "stop-iteration"])
async def test_an_error_that_cannot_travel_arrives_as_loader_worker_error(
        gpt, error, described, why) -> None:
    failure = await _fail_at_sample_6(gpt, error)
    assert type(failure) is LoaderWorkerError
    assert (failure.worker, failure.batch) == (0, 3)
    assert re.fullmatch(rf"loader worker 0 failed on batch 3 \(samples from 0 \+ 3 steps\) "
                        rf"with {described}; not raised as itself: {why}", str(failure)), \
        str(failure)
    assert f"{type(error).__name__}: " in _remote_traceback(failure)


def test_an_error_report_fits_one_pipe_record_and_keeps_the_traceback_end() -> None:
    """However long the message, the pickle and the traceback, a report is at most
    MAX_ERROR_BYTES (a record is one atomic pipe write) and keeps the traceback's last
    lines."""

    def deep() -> None:  # a long chained cause, a long message, a long attribute
        try:
            raise KeyError("k" * 5000)
        except KeyError as exc:
            raise CorruptDatasetError("m" * 3000, path="p" * 3000) from exc

    for make in (deep, lambda: _raise(ValueError("short"))):
        try:
            make()
        except Exception as exc:
            report = _workers.report_error(exc)
            error = exc
        assert len(report) <= _workers.MAX_ERROR_BYTES
        found = _workers.raised_in_worker(report, worker=1, batch=7, first_sample=8)
        remote = str(found.__cause__)
        assert f"{type(error).__name__}: " in remote and remote.endswith('"""')
        if isinstance(error, ValueError):
            assert type(found) is ValueError and not remote.startswith('\n"""\n[...]')
        else:  # too large to pickle within the bound: described, cut
            assert type(found) is LoaderWorkerError
            assert remote.startswith('\n"""\n[...]\n')
            assert "in deep\n" in remote  # the frames, not only the long message
            assert len(str(found)) < 1000


def _raise(error: Exception) -> None:
    raise error


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


@pytest.mark.gpu
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

