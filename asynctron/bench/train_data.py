"""Data inside a busy trainer: asynctron's AsyncLoader against torch's DataLoader (2 and 4
worker processes) over megatron's GPTDataset, and megatron's plain `ds[i]` loop.

Every run is a fresh process reading a corpus larger than the prefetch window (default 1 GiB
of uint16 tokens; 2048-token samples, micro batch 8, a 64 MiB prefetch budget, 4 batches
ahead), for `--duration` seconds, with the page cache of every file it reads either evicted
first (`cold`) or warm. Beside it a trainer thread works (`asynctron/bench/_trainers.py`): none
(`idle`), pure Python holding the GIL (`python`), the same bound to the first CPU with every
loader's worker processes bound to the others, as on a node where ranks are bound to cores
(`python-bound`; asynctron's `worker_cpus`, DataLoader's `worker_init_fn`), Python with a tiny
torch op every few microseconds, giving the GIL up at each as a GPU trainer's dispatch thread
does when it launches kernels (`dispatch`), or 1-thread torch matmuls (`torch`).
Measured: samples/s, the wait for each batch (p50/p95/max), the first batch's latency (from
opening the dataset: imports, index maps, worker start), and the trainer's work retained
while batches flow (its rate from the first batch asked for to the last one taken / its mean
rate in a second before the dataset was opened and a second after the loader was done, so a
drift of the machine's speed over the run cancels). The consumer takes batches as fast as they
come: for asynctron on the event loop (`async for`), for the others on the main thread. With
`--pace-ms`, it works that long after each batch, as a trainer's step would, and its waits
are counted from the end of that work.

DataLoader gets megatron's settings (`pin_memory` where CUDA is, `persistent_workers=True`,
`batch_sampler` in megatron's pretraining order); asynctron its defaults (2 workers at nice
+10, kept off the cores of the process's busy threads). Methods take turns in a seeded shuffled
order per round; medians of `--repeats`.

Run: `asynctron bench train_data`; `--quick` for a smoke run.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

from asynctron.bench import _results
from asynctron.bench._corpus import megatron_modules, write_corpus
from asynctron.bench._rounds import round_order
from asynctron.bench._trainers import TrainerThread
from asynctron.bench.data_throughput import _configs
from asynctron.datasets import GPTDataset, IndexedDataset, Split

MiB = 1 << 20
METHODS = ("asynctron AsyncLoader", "DataLoader (2 workers)", "DataLoader (4 workers)",
           "megatron ds[i]")
TRAINERS = ("idle", "python", "python-bound", "dispatch", "torch")
CACHES = ("cold", "warm")


def _datasets(prefix: str, cache: str, length: int, which: str) -> Any:
    """The GPT dataset for `which` ("asynctron" or "megatron"; megatron falls back to
    asynctron's classes where megatron-core does not import), configured as `bench data`'s."""
    megatron = megatron_modules()[0] if which == "megatron" else None
    ours_config, theirs_config = _configs(megatron, cache, length, False)
    if megatron is not None:
        low = megatron["indexed"].IndexedDataset(prefix)
        return megatron["gpt"].GPTDataset(low, prefix, np.arange(len(low), dtype=np.int32),
                                          None, megatron["Split"].train, theirs_config)
    low = IndexedDataset(prefix)
    return GPTDataset(low, prefix, np.arange(len(low), dtype=np.int32), None, Split.train,
                      ours_config)


# one run, in a fresh process ------------------------------------------------------------------

class _Consumer:
    """Times batches as the consumer takes them, and counts the trainer's work meanwhile."""

    def __init__(self, duration_s: float, micro_batch_size: int,
                 trainer: TrainerThread | None, pace_s: float) -> None:
        self.duration_s = duration_s
        self.pace_s = pace_s
        self.micro_batch_size = micro_batch_size
        self.trainer = trainer
        self.waits: list[float] = []
        self.created = time.perf_counter()
        self.first_batch_s: float | None = None
        self.started = 0.0
        self._last = 0.0

    def begin(self) -> None:
        """Batches start to flow (the loader and its workers exist)."""
        self.started = self._last = time.perf_counter()
        self.trainer_begin = self.trainer.count if self.trainer else 0

    def took(self) -> bool:
        """Count a batch; False once the duration is over."""
        now = time.perf_counter()
        if self.first_batch_s is None:
            self.first_batch_s = now - self.created
        self.waits.append(now - self._last)
        self._last = now
        self.trainer_end = self.trainer.count if self.trainer else 0
        return now - self.started < self.duration_s

    def stepped(self) -> None:
        """A paced consumer's step is over: the wait for the next batch starts now."""
        self._last = time.perf_counter()

    def result(self) -> dict[str, Any]:
        elapsed = self._last - self.started
        waits = sorted(self.waits)
        return {"samples_per_s": len(waits) * self.micro_batch_size / elapsed,
                "trainer_rate": (self.trainer_end - self.trainer_begin) / elapsed,
                "wait_p50_s": waits[len(waits) // 2],
                "wait_p95_s": waits[min(len(waits) - 1, int(len(waits) * 0.95))],
                "wait_max_s": waits[-1], "first_batch_s": self.first_batch_s,
                "num_batches": len(waits)}


def _sampler(length: int, micro_batch_size: int) -> list[list[int]]:
    """Megatron's pretraining order on one rank: consecutive micro batches."""
    return [list(range(i, i + micro_batch_size))
            for i in range(0, length - micro_batch_size + 1, micro_batch_size)]


def _run_plain(dataset: Any, consumer: _Consumer) -> None:
    consumer.begin()
    for ids in _sampler(len(dataset), consumer.micro_batch_size):
        [dataset[i] for i in ids]
        if not consumer.took():
            return
        if consumer.pace_s:
            time.sleep(consumer.pace_s)
            consumer.stepped()


def _run_dataloader(dataset: Any, consumer: _Consumer, num_workers: int,
                    worker_cpus: set[int] | None) -> None:
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=_sampler(len(dataset), consumer.micro_batch_size),
        num_workers=num_workers, pin_memory=torch.cuda.is_available(),
        persistent_workers=True,
        worker_init_fn=None if worker_cpus is None else _Bind(worker_cpus))
    batches = iter(loader)  # starts the workers
    consumer.begin()
    for _ in batches:
        if not consumer.took():
            return
        if consumer.pace_s:
            time.sleep(consumer.pace_s)
            consumer.stepped()


class _Bind:
    """DataLoader's `worker_init_fn`: bind the worker to `cpus`."""

    def __init__(self, cpus: set[int]) -> None:
        self.cpus = cpus

    def __call__(self, _: int) -> None:
        os.sched_setaffinity(0, self.cpus)


def _run_asynctron(dataset: Any, consumer: _Consumer, budget_bytes: int, watched: bool,
                   worker_cpus: set[int] | None) -> dict[str, Any]:
    """The loader on the event loop, with its defaults but `worker_cpus` where given;
    `watched`: with a 5 ms heartbeat on the loop (its wake-ups take the GIL, so it runs only
    beside an idle trainer)."""
    import contextlib

    import uvloop

    from asynctron import Engine
    from asynctron.datasets import AsyncLoader
    from asynctron.testing import LoopWatchdog

    async def run() -> dict[str, Any]:
        dog = LoopWatchdog(0.005) if watched else None
        async with Engine(num_workers=2) as engine, AsyncLoader(
                dataset, micro_batch_size=consumer.micro_batch_size,
                run_blocking=engine.run_blocking, prefetch_budget=budget_bytes,
                num_ready_batches=4,
                **({} if worker_cpus is None else {"worker_cpus": worker_cpus})) as loader, \
                dog or contextlib.nullcontext():
            consumer.begin()
            async for _ in loader:
                if not consumer.took():
                    break
                if consumer.pace_s:
                    await asyncio.sleep(consumer.pace_s)
                    consumer.stepped()
        return {"loop_worst_delay_s": dog.report().worst_delay_s} if dog else {}

    return uvloop.run(run())


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One method beside one trainer (in this fresh process)."""
    torch.set_num_threads(1)
    which = "asynctron" if args.method.startswith("asynctron") else "megatron"
    cpus = sorted(os.sched_getaffinity(0))
    bound = args.trainer.endswith("-bound") and len(cpus) > 1
    trainer_cpus, worker_cpus = ({cpus[0]}, set(cpus[1:])) if bound else (None, None)
    trainer = (TrainerThread(args.trainer.removesuffix("-bound"), trainer_cpus)
               if args.trainer != "idle" else None)
    if trainer is not None:
        trainer.start()
        time.sleep(0.2)
    try:
        alone_before = _rate_alone(trainer, args.rate_window_s)
        consumer = _Consumer(args.duration, args.micro_batch_size, trainer,
                             (args.pace_ms or 0) / 1e3)
        dataset = _datasets(args.prefix, args.cache, args.sequence_length, which)
        extra: dict[str, Any] = {}
        if args.method == "asynctron AsyncLoader":
            extra = _run_asynctron(dataset, consumer, args.prefetch_mib * MiB,
                                   watched=trainer is None, worker_cpus=worker_cpus)
        elif args.method.startswith("DataLoader"):
            _run_dataloader(dataset, consumer, int(args.method.split("(")[1].split()[0]),
                            worker_cpus)
        else:
            _run_plain(dataset, consumer)
        alone_after = _rate_alone(trainer, args.rate_window_s)
    finally:
        if trainer is not None:
            trainer.stop()
    result = {**consumer.result(), **extra, "dataset": type(dataset).__module__}
    if trainer is not None:
        result["retained"] = result.pop("trainer_rate") / ((alone_before + alone_after) / 2)
    else:
        del result["trainer_rate"]
    return result


def _rate_alone(trainer: TrainerThread | None, window_s: float) -> float:
    """The trainer's units per second over `window_s` (a second; a quarter in a smoke run)
    with no loader at work."""
    if trainer is None:
        return 0.0
    count, started = trainer.count, time.perf_counter()
    time.sleep(window_s)
    return (trainer.count - count) / (time.perf_counter() - started)


# the harness ----------------------------------------------------------------------------------

def _evict(paths: list[str]) -> None:
    from asynctron.bench._baselines import evict_page_cache

    evict_page_cache(paths)


def _files(work: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(work) for name in names]


def _spawn(args: argparse.Namespace, method: str, trainer: str, work: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "asynctron.bench.train_data", "--one", "--method", method,
               "--trainer", trainer, "--prefix", f"{work}/corpus", "--cache", f"{work}/cache",
               "--duration", str(args.duration), "--micro-batch-size",
               str(args.micro_batch_size), "--sequence-length", str(args.sequence_length),
               "--prefetch-mib", str(args.prefetch_mib), "--pace-ms", str(args.pace_ms or 0),
               "--rate-window-s", str(args.rate_window_s)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{method} / {trainer}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_all(args: argparse.Namespace, work: str) -> dict[str, Any]:
    write_corpus(f"{work}/corpus", args.corpus_mib * MiB // 2, seed=1)
    for which in ("asynctron", "megatron"):  # the index caches, built once
        _datasets(f"{work}/corpus", f"{work}/cache", args.sequence_length, which)
    samples: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    for cache in args.caches:
        for trainer in args.trainers:
            for round_index in range(args.repeats):
                for method in round_order(list(args.methods), round_index):
                    if cache == "cold":
                        _evict(_files(work))
                    else:
                        for path in _files(work):  # read every file once: warm
                            with open(path, "rb") as f:
                                while f.read(64 * MiB):
                                    pass
                    result = _spawn(args, method, trainer, work)
                    label = (f"{trainer}, a batch per {args.pace_ms:g} ms" if args.pace_ms
                             else trainer)
                    record = samples.setdefault(cache, {}).setdefault(label, {}).setdefault(
                        method, {})
                    for key, value in result.items():
                        if isinstance(value, float | int):
                            record.setdefault(key, []).append(float(value))
                    print(f"  {cache:<5}{trainer:<7}round {round_index} {method:<24}"
                          f"{result['samples_per_s']:>10,.0f} samples/s  wait p95 "
                          f"{result['wait_p95_s'] * 1e3:8.1f} ms  first "
                          f"{result['first_batch_s']:6.3f} s"
                          + (f"  retained {result['retained']:.0%}" if "retained" in result
                             else ""), flush=True)
    return samples


def report(samples: dict[str, Any]) -> dict[str, Any]:
    """Print the medians and ratios; return them (JSON-able)."""
    summary: dict[str, Any] = {}
    for cache, by_trainer in samples.items():
        for trainer, by_method in by_trainer.items():
            print(f"\n== {cache} page cache, trainer {trainer} ==")
            medians = {m: {k: _median(v) for k, v in r.items()} for m, r in by_method.items()}
            best_peer = max((v["samples_per_s"] for m, v in medians.items()
                             if not m.startswith("asynctron")), default=float("nan"))
            for method, row in medians.items():
                print(f"  {method:<24}{row['samples_per_s']:>10,.0f} samples/s  wait p50/p95/max"
                      f" {row['wait_p50_s'] * 1e3:6.2f} / {row['wait_p95_s'] * 1e3:7.1f} / "
                      f"{row['wait_max_s'] * 1e3:7.1f} ms  first {row['first_batch_s']:6.3f} s"
                      + (f"  retained {row['retained']:.0%}" if "retained" in row else ""))
            ours = medians.get("asynctron AsyncLoader")
            if ours is not None:
                ours["over_best_peer"] = ours["samples_per_s"] / best_peer
                print(f"  asynctron / best peer: {ours['over_best_peer']:.2f}x")
            summary.setdefault(cache, {})[trainer] = medians
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench train_data",
                                     description=_results.description(__doc__))
    parser.add_argument("--dir", default=os.getcwd(), help="where the corpus is written")
    parser.add_argument("--corpus-mib", type=int, default=1024)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--prefetch-mib", type=int, default=64)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pace-ms", type=float, default=0.0,
                        help="the consumer takes a batch, then works this long (a trainer's "
                             "step) before the next; 0: as fast as batches come")
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--quick", action="store_true", help="tiny corpus, short runs (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate-window-s", type=float, default=1.0, help=argparse.SUPPRESS)
    for hidden in ("--method", "--trainer", "--prefix", "--cache"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return 0
    if args.quick:
        args.corpus_mib, args.sequence_length, args.repeats = 16, 256, 1
        args.duration = min(args.duration, 1.0)
        args.rate_window_s = 0.25  # the trainer's rate alone, before and after each run
    args.trainers, args.caches = args.trainers.split(","), args.caches.split(",")
    args.methods = args.methods.split(",")
    started = time.time()
    work = _results.scratch_dir(f"asynctron-bench-train-data-{os.getpid()}-", args.dir)
    try:
        samples = run_all(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {"medians": report(samples), "samples": samples}
    summary["meta"] = _results.run_meta(
        started, args, torch=torch.__version__, cpu_count=os.cpu_count(),
        page_cache="cold: evicted with posix_fadvise(DONTNEED) before each run; warm: every "
                   "file read once before each run")
    _results.write_results("train_data", summary, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
