"""DCP plugin benchmark: stock `torch.distributed.checkpoint` through its own FileSystemWriter
and through asynctron's plugins (`asynctron.dcp`), in one process, on the same state dict.

Per target directory (a tmpfs such as /dev/shm, and one on a disk):
- `dcp.save`, durable: stock `FileSystemWriter(sync_files=True)` at 1, 2 and 4 threads, and
  `asynctron.dcp.StorageWriter`; the ratio is asynctron's throughput over the best stock
  thread count's (above 1: asynctron is faster);
- `dcp.async_save`: the time it blocks the caller (the staging) and until the save is
  durable, stock (the writer stages with its default `BlockingAsyncStager`: a fresh CPU copy)
  against asynctron's `StorageWriter` (which stages into asynctron's warm slabs); the ratio is
  asynctron's blocking time over stock's (below 1: the trainer waits less);
- the physical baseline: one thread writing the same bytes with large pwritev calls, fsynced.
Methods take turns in a shuffled order each round after an untimed warm-up round; medians of
the rounds are reported. Guest memory is warmed first (see `_baselines.warm_guest_memory`).

Run: `asynctron bench dcp` (`python -m asynctron.bench.dcp_plugin`); `--quick` for a smoke
run; `--target DIR` (repeatable) for where to save.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import asynctron
import asynctron.dcp
from asynctron.bench import _baselines, _results
from asynctron.bench._rounds import round_order

GiB = 1 << 30
MiB = 1 << 20
RAW = "raw pwrite+fsync"
OURS = "asynctron.dcp"
OURS_ASYNC = "asynctron.dcp async_save"
STOCK_THREADS = (1, 2, 4)


def _stock(threads: int) -> str:
    return f"stock FileSystemWriter ({threads} thread{'s' * (threads > 1)})"


def _fresh_dir(target: str) -> str:
    """A new, empty run directory under `target` (removed at the end)."""
    os.makedirs(target, exist_ok=True)
    return _results.scratch_dir("asynctron-bench-dcp-", target)


def _drop(path: str) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _save_methods(state: dict[str, torch.Tensor], buffers: list[Any]
                  ) -> dict[str, Callable[[str], None]]:
    """Each `dcp.save` method (and the baseline): a call that saves into a new path."""
    import torch.distributed.checkpoint as dcp

    def stock(threads: int) -> Callable[[str], None]:
        def save(path: str) -> None:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(
                path, thread_count=threads, sync_files=True))
        return save

    def ours(path: str) -> None:
        dcp.save(state, storage_writer=asynctron.dcp.StorageWriter(path))

    def raw(path: str) -> None:
        _baselines.raw_pwrite_fsync(buffers, path)

    return {RAW: raw, **{_stock(n): stock(n) for n in STOCK_THREADS}, OURS: ours}


def _async_methods(state: dict[str, torch.Tensor]
                   ) -> dict[str, Callable[[str], tuple[float, float]]]:
    """Each `dcp.async_save` method: a call returning (blocking, total) seconds."""
    import torch.distributed.checkpoint as dcp

    def timed(make_writer: Callable[[str], Any]) -> Callable[[str], tuple[float, float]]:
        def save(path: str) -> tuple[float, float]:
            writer = make_writer(path)
            started = time.perf_counter()
            future = dcp.async_save(state, storage_writer=writer)
            blocked = time.perf_counter() - started
            future.result()
            return blocked, time.perf_counter() - started
        return save

    return {
        "stock async_save (FileSystemWriter, 1 thread)": timed(
            lambda path: dcp.FileSystemWriter(path, sync_files=True)),
        "stock async_save (FileSystemWriter, 4 threads)": timed(
            lambda path: dcp.FileSystemWriter(path, thread_count=4, sync_files=True)),
        OURS_ASYNC: timed(asynctron.dcp.StorageWriter),
    }


def run_target(target: str, state: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    """Every method on `target`, `repeats` timed rounds after a warm-up round."""
    buffers = _baselines.state_dict_buffers(state)
    saves = _save_methods(state, buffers)
    async_saves = _async_methods(state)
    run_dir = _fresh_dir(target)
    times: dict[str, list[float]] = {name: [] for name in saves}
    blocking: dict[str, list[float]] = {name: [] for name in async_saves}
    totals: dict[str, list[float]] = {name: [] for name in async_saves}
    names = [*saves, *async_saves]
    try:
        for round_index in range(repeats + 1):
            for name in round_order(names, round_index):
                path = os.path.join(run_dir, f"ckpt-{round_index}")
                _drop(path)
                gc.collect()
                if name in saves:
                    started = time.perf_counter()
                    saves[name](path)
                    elapsed = time.perf_counter() - started
                    if round_index:
                        times[name].append(elapsed)
                else:
                    blocked, total = async_saves[name](path)
                    if round_index:
                        blocking[name].append(blocked)
                        totals[name].append(total)
                _drop(path)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"save_s": times, "async_blocking_s": blocking, "async_total_s": totals}


def summarize(target: str, measured: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """Medians, throughputs and the two ratios the plugin is held to."""
    median = {name: statistics.median(values) for name, values in measured["save_s"].items()}
    blocking = {name: statistics.median(values)
                for name, values in measured["async_blocking_s"].items()}
    totals = {name: statistics.median(values)
              for name, values in measured["async_total_s"].items()}
    best_stock = min((_stock(n) for n in STOCK_THREADS), key=median.__getitem__)
    stock_blocking = min(seconds for name, seconds in blocking.items() if name != OURS_ASYNC)
    return {
        "target": target, "nbytes": nbytes,
        "save_median_s": median,
        "save_gb_per_s": {name: nbytes / s / 1e9 for name, s in median.items()},
        "best_stock": best_stock,
        "save_ratio": median[best_stock] / median[OURS],
        "save_vs_baseline": median[RAW] / median[OURS],
        "async_blocking_median_s": blocking, "async_total_median_s": totals,
        "async_blocking_ratio": blocking[OURS_ASYNC] / stock_blocking,
        "samples": measured,
    }


def report(summary: dict[str, Any]) -> None:
    gb = summary["nbytes"] / 1e9
    print(f"\n{summary['target']}: {gb:.2f} GB state dict, medians")
    for name, seconds in summary["save_median_s"].items():
        print(f"  dcp.save  {name:<46} {seconds:7.3f} s  "
              f"{summary['save_gb_per_s'][name]:5.2f} GB/s")
    for name, seconds in summary["async_blocking_median_s"].items():
        print(f"  async_save {name:<45} blocks {seconds:7.3f} s, durable after "
              f"{summary['async_total_median_s'][name]:7.3f} s")
    print(f"  dcp.save: asynctron.dcp is {summary['save_ratio']:.2f}x the best stock writer "
          f"({summary['best_stock']}) [target >= 1.0x]; "
          f"{summary['save_vs_baseline']:.2f}x the raw pwrite+fsync baseline")
    print(f"  async_save blocking: asynctron.dcp / stock's shortest = "
          f"{summary['async_blocking_ratio']:.2f}x [target <= 0.5x]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench dcp",
                                     description=_results.description(__doc__))
    parser.add_argument("--size-gib", type=float, default=1.0, help="state dict size")
    parser.add_argument("--target", action="append", default=None,
                        help="directory to save into (repeatable; default: /dev/shm and "
                             "./asynctron-bench-tmp on the working directory's disk)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small state, one round (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.repeats = min(args.size_gib, 0.03), 1
    targets = args.target or [t for t in ("/dev/shm",) if os.path.isdir(t)] + [
        os.path.join(os.getcwd(), "asynctron-bench-tmp")]
    # One process, no process group: DCP says so on every call.
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    started = time.time()
    warmed = 0 if args.quick else _baselines.warm_guest_memory()
    state = _baselines.make_state_dict(int(args.size_gib * GiB), seed=1)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    summaries = []
    for target in targets:
        summary = summarize(target, run_target(target, state, args.repeats), nbytes)
        report(summary)
        summaries.append(summary)
    results = {"targets": summaries, "meta": _results.run_meta(
        started, args, torch=torch.__version__, warmed_guest_memory_bytes=warmed,
        staging=repr(asynctron.staging_statistics()))}
    _results.write_results("dcp_plugin", results, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
