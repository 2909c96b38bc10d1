"""Data benchmark: asynctron's datasets against megatron-core's, in one process, same inputs.

Scenarios (medians of `--repeats` runs after a warm-up; ratios > 1 mean asynctron is faster):
1. index build: the sample index alone (numpy vs megatron's C++ `build_sample_idx`) and a whole
   GPTDataset index build on a cache miss (document + sample + shuffle index, saved), for
   `--index-samples` samples; the blending index (asynctron's C vs megatron's C++, identical
   arrays checked) for `--blend-samples` samples of 3 datasets: time, and the peak RSS growth
   of one build in a fresh process (the same measure for both).
1b. blend at scale (`scale`): `--scale-samples` samples of 10 datasets (1 B: 10 GB of output),
   each build alone in a fresh process, asynctron's then megatron's where memory allows: time,
   peak RSS growth, and digests of the arrays (identical or not).
2. warm random access: `ds[i]` samples/s over a random order, page cache warm, with and
   without `create_attention_mask`.
3. cold epoch: `--cold-samples` samples in loader order after evicting every file the
   datasets read (`posix_fadvise(DONTNEED)`, fresh maps): megatron `ds[i]` one by one, asynctron
   `ds[i]` one by one (no prefetch), and asynctron's `AsyncLoader` with prefetch; the loop's
   worst heartbeat delay while the loader runs.

Run: `asynctron bench data`; `--quick` for a smoke run. With `--source s3://bucket/prefix` (or
`--source s3`: a local SeaweedFS) it runs the object-storage benchmark instead
(`asynctron.bench.data_s3`, which takes its own options).
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import uvloop
import xxhash

from asynctron import Engine
from asynctron.bench import _results
from asynctron.bench._baselines import evict_page_cache
from asynctron.bench._corpus import BenchTokenizer, megatron_modules, write_corpus
from asynctron.bench._rounds import round_order
from asynctron.datasets import (
    AsyncLoader,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    Split,
    build_blending_indices,
    build_sample_index,
)
from asynctron.testing import LoopWatchdog

MiB = 1 << 20
GiB = 1 << 30
BLEND_WEIGHTS = [0.3, 0.5, 0.2]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


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


def _configs(megatron: Any, cache: str, length: int, mask: bool) -> tuple[Any, Any]:
    ours = GPTDatasetConfig(random_seed=1234, sequence_length=length, tokenizer=BenchTokenizer(),
                            path_to_cache=f"{cache}/ours", create_attention_mask=mask)
    theirs = None
    if megatron is not None:
        theirs = megatron["gpt"].GPTDatasetConfig(
            random_seed=1234, sequence_length=length, tokenizer=BenchTokenizer(),
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

    runs = {"asynctron blending index (C)":
            lambda: build_blending_indices(BLEND_WEIGHTS, blend_samples)}
    if megatron is not None:
        expected = _megatron_blend(megatron["helpers"], BLEND_WEIGHTS, blend_samples)
        ours = build_blending_indices(BLEND_WEIGHTS, blend_samples)
        assert all(map(np.array_equal, ours, expected)), "blending index differs"
        del expected, ours
        runs["megatron blending index (C++)"] = lambda: _megatron_blend(
            megatron["helpers"], BLEND_WEIGHTS, blend_samples)
    timings.update(_timed_together(runs, repeats))
    out["blend_samples"] = blend_samples
    out["blend_output_bytes"] = blend_samples * 10
    out["blend_peak_rss_growth_bytes"] = {
        name: _blend_in_fresh_process(name.split()[0], BLEND_WEIGHTS, blend_samples)[
            "peak_rss_growth_bytes"] for name in runs}
    out["timings_s"] = timings
    return out


# 1b. blending indices at scale --------------------------------------------------------------

def _megatron_blend(helpers: Any, weights: list[float], size: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """megatron's blend as its BlendedDataset builds it (np.zeros, then the C++ helper)."""
    dataset_index = np.zeros(size, np.int16)
    sample_index = np.zeros(size, np.int64)
    helpers.build_blending_indices(dataset_index, sample_index, np.array(weights),
                                   len(weights), size, False)
    return dataset_index, sample_index


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"/proc/self/status: expected a {field} line, found none")


def _blend_once(which: str, weights: list[float], size: int) -> dict[str, Any]:
    """One blend by `which` ("asynctron" or "megatron") in this process: its seconds, its peak
    RSS growth (Linux's high-water mark, reset to the RSS just before) and its arrays' digest."""
    build = (functools.partial(_megatron_blend, megatron_modules()[0]["helpers"], weights, size)
             if which == "megatron" else functools.partial(build_blending_indices, weights, size))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    arrays = build()
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    return {"seconds": seconds, "peak_rss_growth_bytes": peak - before,
            "digest": "-".join(xxhash.xxh3_128_hexdigest(a) for a in arrays)}


def _blend_in_fresh_process(which: str, weights: list[float], size: int) -> dict[str, Any]:
    """`_blend_once` in a fresh interpreter, so that no memory freed before is reused."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_blend_once, (which, weights, size))


def bench_blend_scale(megatron: Any, size: int, repeats: int) -> dict[str, Any]:
    """`size` samples of 10 datasets (random normalized weights), each build alone in a fresh
    process, asynctron's first; a side runs only where the memory available holds 1.25 times
    its output."""
    rng = np.random.default_rng(10)
    weights = rng.random(10)
    weights = (weights / weights.sum()).tolist()
    out: dict[str, Any] = {"samples": size, "weights": weights, "output_bytes": size * 10}
    for which in ("asynctron", "megatron") if megatron is not None else ("asynctron",):
        available = psutil.virtual_memory().available
        if available < size * 10 * 1.25:
            out[which] = (f"not run: {available / GiB:.1f} GiB available for "
                          f"{size * 10 / GiB:.1f} GiB of output")
            continue
        runs = [_blend_in_fresh_process(which, weights, size) for _ in range(repeats)]
        out[which] = {"seconds": [r["seconds"] for r in runs],
                      "peak_rss_growth_bytes": max(r["peak_rss_growth_bytes"] for r in runs),
                      "digest": runs[0]["digest"]}
    if all(isinstance(out.get(which), dict) for which in ("asynctron", "megatron")):
        out["identical"] = out["asynctron"]["digest"] == out["megatron"]["digest"]
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
    evict_page_cache(paths)


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
    if "blend_scale" in results:
        _report_blend_scale(results["blend_scale"])
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
                         ("asynctron blending index (C)", "megatron blending index (C++)")):
        if theirs in t:
            print(f"  {ours} / {theirs}: {t[ours] / t[theirs]:.2f}x the time")
    peaks = index["blend_peak_rss_growth_bytes"]
    print(f"  blending index peak RSS growth (output {index['blend_output_bytes'] / MiB:,.0f} "
          "MiB): " + ", ".join(f"{name.split()[0]} {v / MiB:,.1f} MiB"
                               for name, v in peaks.items()))
    if len(peaks) == 2 and min(peaks.values()) > 0:  # a tiny build may reuse resident pages
        ours, theirs = peaks.values()
        print(f"  blending index asynctron / megatron: {ours / theirs:.2f}x the peak memory")


def _report_blend_scale(scale: dict[str, Any]) -> None:
    print(f"\n== blending index at scale: {scale['samples']:,} samples of "
          f"{len(scale['weights'])} datasets (output {scale['output_bytes'] / GiB:.1f} GiB) ==")
    for which in ("asynctron", "megatron"):
        entry = scale.get(which)
        if isinstance(entry, dict):
            print(f"  {which:<10}{_median(entry['seconds']):>8.2f} s (median of "
                  f"{len(entry['seconds'])}), peak RSS growth "
                  f"{entry['peak_rss_growth_bytes'] / GiB:.2f} GiB")
        elif entry is not None:
            print(f"  {which:<10}{entry}")
    if "identical" in scale:
        ours, theirs = scale["asynctron"], scale["megatron"]
        time_ratio = _median(ours["seconds"]) / _median(theirs["seconds"])
        peak, their_peak = ours["peak_rss_growth_bytes"], theirs["peak_rss_growth_bytes"]
        memory = f", {peak / their_peak:.2f}x the peak memory" if their_peak > 0 else ""
        print(f"  asynctron / megatron: {time_ratio:.2f}x the time{memory}; arrays "
              f"{'identical' if scale['identical'] else 'DIFFER'}")


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
                                     description=_results.description(__doc__))
    parser.add_argument("--dir", default=os.getcwd(),
                        help="where the corpora are written (a disk, for the cold epoch)")
    parser.add_argument("--corpus-mib", type=int, default=4096,
                        help="corpus size (uint16 tokens); keep it well above what the mmap "
                             "read-around of the first faults pulls in (see docs)")
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--index-samples", type=int, default=20_000_000)
    parser.add_argument("--blend-samples", type=int, default=50_000_000)
    parser.add_argument("--scale-samples", type=int, default=1_000_000_000,
                        help="the blend at scale (10 datasets; 10 bytes of output a sample)")
    parser.add_argument("--warm-reads", type=int, default=20_000)
    parser.add_argument("--cold-samples", type=int, default=8_000)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--prefetch-mib", type=int, default=64)
    parser.add_argument("--scenarios", default="index,scale,warm,cold",
                        help="comma-separated subset of index,scale,warm,cold")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    parser.add_argument("--skip-megatron", action="store_true",
                        help="do not run megatron-core even where it imports")
    parser.add_argument("--source", default=None,
                        help="s3://bucket/prefix, or s3 for a local SeaweedFS: benchmark the "
                             "datasets on object storage instead (asynctron.bench.data_s3; "
                             "`python -m asynctron.bench.data_s3 --help` lists its options)")
    if parser.parse_known_args(argv)[0].source is not None:
        from asynctron.bench import data_s3

        return data_s3.main(argv)
    args = parser.parse_args(argv)
    if args.quick:
        args.corpus_mib, args.sequence_length, args.index_samples = 4, 256, 200_000
        args.blend_samples, args.warm_reads, args.cold_samples, args.repeats = 20_000, 200, 64, 1
        args.scale_samples = 200_000
    megatron, reason = ((None, "skipped (--skip-megatron)") if args.skip_megatron
                        else megatron_modules())
    started = time.time()
    work = _results.scratch_dir(f"asynctron-bench-data-{os.getpid()}-", args.dir)
    results: dict[str, Any] = {"megatron": None if megatron else f"not run: {reason}"}
    try:
        prefix = f"{work}/corpus"
        write_corpus(prefix, args.corpus_mib * MiB // 2, seed=1)
        scenarios = set(args.scenarios.split(","))
        if "index" in scenarios:
            results["index_build"] = bench_index_build(megatron, work, args.index_samples,
                                                       args.blend_samples, args.repeats)
        if "scale" in scenarios:
            results["blend_scale"] = bench_blend_scale(megatron, args.scale_samples,
                                                       args.repeats)
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
    _results.write_results("data_throughput", results, out=args.out)
    return 0


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
