"""Data benchmark: asynctron's datasets against megatron-core's, in one process, same inputs.

Scenarios (medians of `--repeats` runs after a warm-up; ratios > 1 mean asynctron is faster):
1. index build: the sample index alone (numpy vs megatron's C++ `build_sample_idx`) and a whole
   GPTDataset index build on a cache miss (document + sample + shuffle index, saved), for
   `--index-samples` samples; the blending index (Python loop vs megatron's C++) for
   `--blend-samples` samples of 3 datasets.
2. warm random access: `ds[i]` samples/s over a random order, page cache warm, with and
   without `create_attention_mask`.
3. cold epoch: `--cold-samples` samples in loader order after evicting every file the
   datasets read (`posix_fadvise(DONTNEED)`, fresh maps): megatron `ds[i]` one by one, asynctron
   `ds[i]` one by one (no prefetch), and asynctron's `AsyncLoader` with prefetch; the loop's
   worst heartbeat delay while the loader runs.

Run: `python -m bench.data_throughput` (or `asynctron bench data`); `--quick` for a smoke run.
Results: printed, and written as JSON to bench/results/data_throughput_<host>_<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import uvloop

from asynctron import Engine
from asynctron.datasets import (
    AsyncLoader,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    Split,
    _pages,
    build_blending_indices,
    build_sample_index,
)
from asynctron.testing import LoopWatchdog
from bench import _results
from bench._rounds import round_order

MiB = 1 << 20


class _Tok:
    eod = 0
    pad = 65535
    vocab_size = 50_000
    unique_identifiers = {"class": "bench"}  # noqa: RUF012


def _megatron() -> tuple[Any, str | None]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import gpt_dataset, helpers, indexed_dataset
            from megatron.core.datasets.utils import Split as MegatronSplit
    except Exception as exc:  # ImportError or a broken helpers build
        return None, f"{type(exc).__name__}: {exc}"
    return {"helpers": helpers, "gpt": gpt_dataset, "indexed": indexed_dataset,
            "Split": MegatronSplit}, None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    return _timed_together({"": fn}, repeats)[""]


def _timed_together(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Each function once untimed (imports, first-touch of memory), then `repeats` rounds in
    turn, so drift on a shared machine hits every method alike."""
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            gc.collect()
            start = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - start)
    return out


def write_corpus(prefix: str, num_tokens: int, seed: int, sparse: bool = False) -> None:
    """Documents of 1..2000 tokens (uint16, eod-terminated) up to `num_tokens`. With `sparse`
    the .bin is a hole of the right size (for index builds, which read only the .idx)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2000, size=num_tokens // 1000 + 1, dtype=np.int32)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), num_tokens)) + 1]
    if sparse:
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        builder._lengths.extend(lengths)  # index only; the tokens are a hole below
        builder._documents.extend(np.arange(1, lengths.size + 1))
        builder.finalize(prefix + ".idx")
        os.truncate(prefix + ".bin", int(lengths.sum(dtype=np.int64)) * 2)
        return
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        step = 1 << 15  # documents per chunk of random tokens (~32 M tokens, 64 MiB)
        for first in range(0, lengths.size, step):
            chunk = lengths[first:first + step]
            ends = np.cumsum(chunk, dtype=np.int64)
            tokens = rng.integers(1, 50_000, size=int(ends[-1]), dtype=np.uint16)
            tokens[ends - 1] = 0  # every document ends with eod
            for start, end in zip((ends - chunk).tolist(), ends.tolist(), strict=True):
                builder.add_item(tokens[start:end])
                builder.end_document()
        builder.finalize(prefix + ".idx")


def _configs(megatron: Any, cache: str, length: int, mask: bool) -> tuple[Any, Any]:
    ours = GPTDatasetConfig(random_seed=1234, sequence_length=length, tokenizer=_Tok(),
                            path_to_cache=f"{cache}/ours", create_attention_mask=mask)
    theirs = None
    if megatron is not None:
        theirs = megatron["gpt"].GPTDatasetConfig(
            random_seed=1234, sequence_length=length, tokenizer=_Tok(),
            path_to_cache=f"{cache}/megatron", reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=mask)
    return ours, theirs


def _datasets(megatron: Any, prefix: str, num_samples: int | None, config: Any,
              megatron_config: Any) -> tuple[GPTDataset, Any]:
    ours_low = IndexedDataset(prefix)
    indices = np.arange(len(ours_low), dtype=np.int32)
    ours = GPTDataset(ours_low, prefix, indices, num_samples, Split.train, config)
    theirs = None
    if megatron is not None:
        low = megatron["indexed"].IndexedDataset(prefix)
        theirs = megatron["gpt"].GPTDataset(low, prefix, indices, num_samples,
                                            megatron["Split"].train, megatron_config)
    return ours, theirs


# 1. index builds ----------------------------------------------------------------------------

def bench_index_build(megatron: Any, work: str, num_samples: int, blend_samples: int,
                      repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"num_samples": num_samples}
    length = 1024
    rng = np.random.default_rng(0)
    num_documents = 1_000_000 if num_samples >= 1_000_000 else 20_000
    sizes = rng.integers(1, 2000, size=num_documents).astype(np.int32)
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    epochs = -(-(num_samples * length + 1) // tokens_per_epoch)
    document_index = np.tile(np.arange(num_documents, dtype=np.int32), epochs)
    np.random.RandomState(1).shuffle(document_index)
    args = (sizes, document_index, length, epochs, tokens_per_epoch, True, True)
    runs = {"asynctron sample index (numpy)": lambda: build_sample_index(*args)}
    if megatron is not None:
        expected = megatron["helpers"].build_sample_idx(*args)
        assert np.array_equal(expected, build_sample_index(*args)), "sample index differs"
        del expected
        runs["megatron sample index (C++)"] = lambda: megatron["helpers"].build_sample_idx(*args)
    timings = _timed_together(runs, repeats)
    out["sample_index_rows"] = int((epochs * tokens_per_epoch - 1) // length)
    del document_index
    gc.collect()

    prefix = f"{work}/index-corpus"
    write_corpus(prefix, num_samples * length // 8, seed=2, sparse=True)  # 8 epochs

    def build(which: str) -> None:
        cache = tempfile.mkdtemp(dir=work)
        try:
            ours_config, theirs_config = _configs(megatron, cache, length, True)
            if which == "asynctron":
                low = IndexedDataset(prefix)
                GPTDataset(low, prefix, np.arange(len(low), dtype=np.int32), num_samples,
                           Split.train, ours_config)
            else:
                low = megatron["indexed"].IndexedDataset(prefix)
                megatron["gpt"].GPTDataset(low, prefix, np.arange(len(low), dtype=np.int32),
                                           num_samples, megatron["Split"].train, theirs_config)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    runs = {"asynctron GPTDataset build": lambda: build("asynctron")}
    if megatron is not None:
        runs["megatron GPTDataset build"] = lambda: build("megatron")
    timings.update(_timed_together(runs, repeats))

    weights = [0.3, 0.5, 0.2]
    timings["asynctron blending index (Python)"] = _timed(
        lambda: build_blending_indices(weights, blend_samples), 1)
    if megatron is not None:
        def megatron_blend() -> None:
            di = np.zeros(blend_samples, np.int16)
            dsi = np.zeros(blend_samples, np.int64)
            megatron["helpers"].build_blending_indices(di, dsi, np.array(weights), 3,
                                                       blend_samples, False)
        timings["megatron blending index (C++)"] = _timed(megatron_blend, repeats)
    out["blend_samples"] = blend_samples
    out["timings_s"] = timings
    return out


# 2. warm random access ----------------------------------------------------------------------

def bench_warm(megatron: Any, prefix: str, cache: str, num_reads: int, repeats: int,
               length: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mask in (True, False):
        ours_config, theirs_config = _configs(megatron, f"{cache}/warm{mask}", length, mask)
        ours, theirs = _datasets(megatron, prefix, None, ours_config, theirs_config)
        order = np.random.default_rng(3).permutation(len(ours))[:num_reads].tolist()
        with open(prefix + ".bin", "rb") as f:  # warm the page cache
            while f.read(64 * MiB):
                pass

        def read_all(ds: Any, order: list[int] = order) -> None:
            for i in order:
                ds[i]

        runs = {"asynctron": lambda ds=ours: read_all(ds)}
        if theirs is not None:
            runs["megatron"] = lambda ds=theirs: read_all(ds)
        timings = _timed_together(runs, repeats)
        out[f"create_attention_mask={mask}"] = {
            "num_reads": len(order),
            "samples_per_s": {k: len(order) / _median(v) for k, v in timings.items()},
            "timings_s": timings}
    return out


# 3. cold epoch ------------------------------------------------------------------------------

def _evict_all(paths: list[str]) -> None:
    gc.collect()
    os.sync()
    for path in paths:
        _pages.evict(path)


def bench_cold(megatron: Any, prefix: str, cache: str, num_samples: int, repeats: int,
               length: int, micro_batch_size: int, budget_bytes: int) -> dict[str, Any]:
    ours_config, theirs_config = _configs(megatron, f"{cache}/cold", length, False)
    _datasets(megatron, prefix, None, ours_config, theirs_config)  # build the index caches
    files = [prefix + ".bin", prefix + ".idx"]
    for root in (f"{cache}/cold/ours", f"{cache}/cold/megatron"):
        if os.path.isdir(root):
            files += [os.path.join(root, name) for name in os.listdir(root)]
    count = num_samples // micro_batch_size * micro_batch_size
    timings: dict[str, list[float]] = {}
    worst: list[float] = []

    def sequential(which: str) -> float:
        _evict_all(files)
        ours, theirs = _datasets(megatron, prefix, None, ours_config, theirs_config)
        ds = ours if which == "asynctron" else theirs
        start = time.perf_counter()
        for i in range(count):
            ds[i]
        return time.perf_counter() - start

    def loader() -> float:
        _evict_all(files)
        ours, _ = _datasets(None, prefix, None, ours_config, None)

        async def run() -> float:
            async with Engine(num_workers=4) as engine, LoopWatchdog() as dog:
                start = time.perf_counter()
                async with AsyncLoader(ours, micro_batch_size=micro_batch_size,
                                       run_blocking=engine.run_blocking,
                                       prefetch_budget=budget_bytes,
                                       num_ready_batches=4) as it:
                    seen = 0
                    async for _ in it:
                        seen += micro_batch_size
                        if seen >= count:
                            break
                elapsed = time.perf_counter() - start
            worst.append(dog.report().worst_delay_s)
            return elapsed

        return uvloop.run(run())

    async def idle(duration_s: float) -> float:
        async with LoopWatchdog() as dog:
            await asyncio.sleep(duration_s)
        return dog.report().worst_delay_s

    runs = {"asynctron AsyncLoader (prefetch)": loader,
            "asynctron ds[i] (no prefetch)": lambda: sequential("asynctron")}
    if megatron is not None:
        runs["megatron ds[i]"] = lambda: sequential("megatron")
    idle_worst = []
    for round_index in range(repeats):  # methods take turns, so drift hits them alike
        for name in round_order(list(runs), round_index):
            timings.setdefault(name, []).append(runs[name]())
        idle_worst.append(uvloop.run(idle(_median(timings["asynctron AsyncLoader (prefetch)"]))))
    return {"num_samples": count, "micro_batch_size": micro_batch_size,
            "prefetch_budget_bytes": budget_bytes, "timings_s": timings,
            "samples_per_s": {k: count / _median(v) for k, v in timings.items()},
            "loop_worst_delay_s": max(worst) if worst else float("nan"),
            "idle_loop_worst_delay_s": max(idle_worst)}


# report -------------------------------------------------------------------------------------

def report(results: dict[str, Any]) -> None:
    if "index_build" in results:
        _report_index(results["index_build"])
    if "warm" in results:
        _report_warm(results["warm"])
    if "cold" in results:
        _report_cold(results["cold"])
    if results.get("megatron"):
        print(f"\nmegatron: {results['megatron']}")


def _report_index(index: dict[str, Any]) -> None:
    t = {k: _median(v) for k, v in index["timings_s"].items()}
    print(f"\n== index build: {index['sample_index_rows']:,} samples (blend: "
          f"{index['blend_samples']:,}) ==")
    for name, value in t.items():
        print(f"  {name:<40}{value:>10.3f} s")
    for ours, theirs in (("asynctron sample index (numpy)", "megatron sample index (C++)"),
                         ("asynctron GPTDataset build", "megatron GPTDataset build"),
                         ("asynctron blending index (Python)", "megatron blending index (C++)")):
        if theirs in t:
            print(f"  {ours} / {theirs}: {t[ours] / t[theirs]:.2f}x the time")


def _report_warm(warm: dict[str, Any]) -> None:
    print("\n== warm random access (samples/s) ==")
    for label, entry in warm.items():
        rates = entry["samples_per_s"]
        line = "  ".join(f"{k} {v:,.0f}" for k, v in rates.items())
        ratio = (f"  asynctron/megatron {rates['asynctron'] / rates['megatron']:.2f}x"
                 if "megatron" in rates else "")
        print(f"  {label}: {line}{ratio}")


def _report_cold(cold: dict[str, Any]) -> None:
    print(f"\n== cold epoch: {cold['num_samples']:,} samples, micro batch "
          f"{cold['micro_batch_size']}, budget {cold['prefetch_budget_bytes'] / MiB:.0f} MiB ==")
    rates = cold["samples_per_s"]
    for name, value in rates.items():
        print(f"  {name:<40}{value:>12,.0f} samples/s")
    if "megatron ds[i]" in rates:
        print(f"  loader / megatron: {rates['asynctron AsyncLoader (prefetch)'] / rates['megatron ds[i]']:.2f}x")  # noqa: E501
    print(f"  loader / no prefetch: {rates['asynctron AsyncLoader (prefetch)'] / rates['asynctron ds[i] (no prefetch)']:.2f}x")  # noqa: E501
    print(f"  loop worst heartbeat delay while the loader ran: "
          f"{cold['loop_worst_delay_s'] * 1e3:.2f} ms (an idle loop, same duration: "
          f"{cold['idle_loop_worst_delay_s'] * 1e3:.2f} ms)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench data",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.getcwd(),
                        help="where the corpora are written (a disk, for the cold epoch)")
    parser.add_argument("--corpus-mib", type=int, default=4096,
                        help="corpus size (uint16 tokens); keep it well above what the mmap "
                             "read-around of the first faults pulls in (see docs)")
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--index-samples", type=int, default=20_000_000)
    parser.add_argument("--blend-samples", type=int, default=5_000_000)
    parser.add_argument("--warm-reads", type=int, default=20_000)
    parser.add_argument("--cold-samples", type=int, default=8_000)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--prefetch-mib", type=int, default=64)
    parser.add_argument("--scenarios", default="index,warm,cold",
                        help="comma-separated subset of index,warm,cold")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke)")
    parser.add_argument("--out", default=None, help="JSON results path")
    parser.add_argument("--skip-megatron", action="store_true",
                        help="do not run megatron-core even where it imports")
    args = parser.parse_args(argv)
    if args.quick:
        args.corpus_mib, args.sequence_length, args.index_samples = 4, 256, 200_000
        args.blend_samples, args.warm_reads, args.cold_samples, args.repeats = 20_000, 200, 64, 1
    megatron, reason = (None, "skipped (--skip-megatron)") if args.skip_megatron else _megatron()
    started = time.time()
    work = tempfile.mkdtemp(prefix=f"asynctron-bench-data-{os.getpid()}-", dir=args.dir)
    results: dict[str, Any] = {"megatron": None if megatron else f"not run: {reason}"}
    try:
        prefix = f"{work}/corpus"
        write_corpus(prefix, args.corpus_mib * MiB // 2, seed=1)
        scenarios = set(args.scenarios.split(","))
        if "index" in scenarios:
            results["index_build"] = bench_index_build(megatron, work, args.index_samples,
                                                       args.blend_samples, args.repeats)
        if "warm" in scenarios:
            results["warm"] = bench_warm(megatron, prefix, f"{work}/cache", args.warm_reads,
                                         args.repeats, args.sequence_length)
        if "cold" in scenarios:
            results["cold"] = bench_cold(megatron, prefix, f"{work}/cache", args.cold_samples,
                                         args.repeats, args.sequence_length,
                                         args.micro_batch_size, args.prefetch_mib * MiB)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    results["meta"] = _results.run_meta(
        started, args, memory_bytes=psutil.virtual_memory().total, numpy=np.__version__,
        megatron_core=_version("megatron-core"),
        page_cache="warm for 'warm'; evicted with posix_fadvise(DONTNEED) before each 'cold' "
                   "run")
    _results.write_results("data_throughput", results, out=args.out, quick=args.quick)
    return 0


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
