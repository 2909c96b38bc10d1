"""Concurrent write sweep: how fast asynctron saves to *your* storage, and with which settings.

For every combination of bins (= files = writer tasks), executor threads, item size and write
mode (buffered, and O_DIRECT where the filesystem allows it), an `Engine` saves the same state
dict several times; the median GB/s and the event loop's worst heartbeat delay are recorded,
next to the physical baselines measured in the same run (one thread: buffered pwrite+fsync, and
O_DIRECT). Prints a table and a recommendation (the fastest setting whose loop delay stays under
`--max-loop-delay-ms`, preferring fewer threads and bins when within 5%), and draws a PNG.

Each state dict is frozen out of the garbage collector's reach once built (`gc.freeze()`), as a
tuned trainer freezes its model: otherwise a full collection, which stops every thread and
scans torch's ~300K objects in ~200 ms on a 2-core VM, lands in the loop delay whenever a
save of thousands of items allocates enough to trigger one (docs/guide.md, "Tuning").

Run: `asynctron bench write --target DIR` (results in ./asynctron-bench/, or `--out DIR`);
`--quick` for a small grid in about a minute.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import uvloop
from tqdm import tqdm

from asynctron import Engine
from asynctron.bench import _baselines, _results
from asynctron.testing import LoopWatchdog

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Setting:
    num_bins: int
    num_workers: int
    item_bytes: int
    direct_io: bool

    def label(self) -> str:
        mode = "O_DIRECT" if self.direct_io else "buffered"
        return (f"bins={self.num_bins} threads={self.num_workers} "
                f"items={_size(self.item_bytes)} {mode}")


@dataclass(frozen=True, slots=True)
class Result:
    setting: Setting
    median_gb_per_s: float
    samples_s: list[float]
    worst_loop_delay_ms: float


#: The settings swept unless given: the full grid, and `--quick`'s (about a minute on a 1 GB/s
#: disk).
FULL_GRID = {"size_mib": 1024, "bins": "1,2,4,8", "threads": "1,2,4,8",
             "item_sizes_mib": "0.25,4,64,1024", "repeats": 3}
QUICK_GRID = {"size_mib": 256, "bins": "1,4", "threads": "1,4", "item_sizes_mib": "1,64",
              "repeats": 1}


def _size(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB" if (
        nbytes >= MiB) else f"{nbytes >> 10} KiB"


def _state(total_bytes: int, item_bytes: int) -> dict[str, torch.Tensor]:
    count = max(1, total_bytes // item_bytes)
    generator = torch.Generator().manual_seed(0)
    return {f"item_{i:05d}": torch.randint(0, 255, (item_bytes,), dtype=torch.uint8,
                                           generator=generator) for i in range(count)}


def direct_io_works(target: str) -> bool:
    """Whether the filesystem under `target` accepts O_DIRECT (tmpfs does not)."""
    probe = os.path.join(target, f".asynctron-direct-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.remove(probe)
    return True


async def _measure(setting: Setting, state: dict[str, torch.Tensor], nbytes: int, base: str,
                   repeats: int) -> Result:
    samples, worst = [], 0.0
    async with Engine(num_bins=setting.num_bins, num_workers=setting.num_workers,
                      direct_io=setting.direct_io,
                      memory_budget_bytes=max(256 * MiB, (nbytes + 64 * MiB) // (64 * MiB)
                                              * (64 * MiB))) as engine:
        for round_index in range(repeats + 1):  # round 0 warms the slabs
            path = os.path.join(base, f"r{round_index}")
            async with LoopWatchdog() as dog:
                start = time.perf_counter()
                await engine.save(state, path)
                elapsed = time.perf_counter() - start
            await engine.run_blocking(shutil.rmtree, path)
            if round_index:
                samples.append(elapsed)
                worst = max(worst, dog.report().worst_delay_s)
    return Result(setting, nbytes / statistics.median(samples) / 1e9, samples, worst * 1e3)


def _measure_baselines(target: str, nbytes: int, repeats: int, direct: bool) -> dict[str, float]:
    buffers = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()]
    runs: dict[str, list[float]] = {"raw pwrite+fsync (1 thread)": []}
    if direct:
        runs["raw O_DIRECT pwrite+fsync (1 thread)"] = []
    path = os.path.join(target, f".asynctron-raw-{os.getpid()}")
    for _ in range(repeats):
        for name in runs:
            start = time.perf_counter()
            if name.startswith("raw O_DIRECT"):
                _baselines.raw_direct_pwrite_fsync(nbytes, path)
            else:
                _baselines.raw_pwrite_fsync(buffers, path)
            runs[name].append(time.perf_counter() - start)
            os.remove(path)
    return {name: nbytes / statistics.median(times) / 1e9 for name, times in runs.items()}


@dataclass(frozen=True, slots=True)
class Recommendation:
    """A setting of the knobs (item size is the workload's, not a knob), judged over every item
    size: the geometric mean of its speeds and its worst loop delay."""

    num_bins: int
    num_workers: int
    direct_io: bool
    mean_gb_per_s: float
    worst_loop_delay_ms: float


def recommend(results: list[Result], max_loop_delay_ms: float) -> Recommendation:
    """The fastest knob setting within the loop-delay bound; among those within 5% of it, the
    one with the fewest threads, then the fewest bins."""
    by_knobs: dict[tuple[int, int, bool], list[Result]] = {}
    for r in results:
        s = r.setting
        by_knobs.setdefault((s.num_bins, s.num_workers, s.direct_io), []).append(r)
    options = [Recommendation(bins, workers, direct,
                              statistics.geometric_mean(r.median_gb_per_s for r in rs),
                              max(r.worst_loop_delay_ms for r in rs))
               for (bins, workers, direct), rs in by_knobs.items()]
    calm = [o for o in options if o.worst_loop_delay_ms <= max_loop_delay_ms] or options
    best = max(o.mean_gb_per_s for o in calm)
    close = [o for o in calm if o.mean_gb_per_s >= 0.95 * best]
    return min(close, key=lambda o: (o.num_workers, o.num_bins, -o.mean_gb_per_s))


def plot(results: list[Result], baselines: dict[str, float], path: str, title: str) -> None:
    """Draw GB/s against bins, a panel per item size and mode, a line per thread count
    (matplotlib, from the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")  # headless; must precede the pyplot import
    import matplotlib.pyplot as plt

    sizes = sorted({r.setting.item_bytes for r in results})
    modes = sorted({r.setting.direct_io for r in results})
    figure, axes = plt.subplots(len(modes), len(sizes), squeeze=False,
                                figsize=(3.6 * len(sizes), 3.2 * len(modes)), sharey=True)
    for row, direct in enumerate(modes):
        for col, item_bytes in enumerate(sizes):
            axis = axes[row][col]
            for workers in sorted({r.setting.num_workers for r in results}):
                points = sorted((r.setting.num_bins, r.median_gb_per_s) for r in results
                                if r.setting.item_bytes == item_bytes
                                and r.setting.direct_io == direct
                                and r.setting.num_workers == workers)
                axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                          label=f"{workers} threads")
            for name, speed in baselines.items():
                axis.axhline(speed, linestyle="--", linewidth=1,
                             color="black" if "O_DIRECT" in name else "gray")
            axis.set_xscale("log", base=2)
            axis.set_title(f"items {_size(item_bytes)}, {'O_DIRECT' if direct else 'buffered'}",
                           fontsize=9)
            axis.set_xlabel("bins (files, writer tasks)")
            if col == 0:
                axis.set_ylabel("GB/s (median)")
    axes[0][0].legend(fontsize=7)
    figure.suptitle(f"{title} (dashed: raw 1-thread baselines)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench write",
                                     description=_results.description(__doc__))
    parser.add_argument("--target", default=os.getcwd(), help="directory on the storage to test")
    parser.add_argument("--size-mib", type=int, help="bytes saved per run")
    parser.add_argument("--bins", help="comma-separated bin counts (files, writer tasks)")
    parser.add_argument("--threads", help="comma-separated executor thread counts")
    parser.add_argument("--item-sizes-mib", help="comma-separated tensor sizes")
    parser.add_argument("--repeats", type=int, help="saves per setting (median)")
    parser.add_argument("--max-loop-delay-ms", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true",
                        help=f"a small grid in about a minute: {QUICK_GRID}")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP + "; the PNG goes beside")
    args = parser.parse_args(argv)
    for name, value in (QUICK_GRID if args.quick else FULL_GRID).items():
        if getattr(args, name) is None:  # the grid fills in what the command line left out
            setattr(args, name, value)

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    nbytes = args.size_mib * MiB
    item_sizes = sorted({min(nbytes, max(4096, int(float(x) * MiB)))
                         for x in args.item_sizes_mib.split(",") if x})
    direct = direct_io_works(args.target)
    settings = [Setting(b, t, s, d) for s, d, b, t in itertools.product(
        item_sizes, [False, True] if direct else [False], ints(args.bins), ints(args.threads))]
    base = _results.scratch_dir(f"asynctron-write-sweep-{os.getpid()}-", args.target)
    started = time.time()
    try:
        baselines = _measure_baselines(args.target, nbytes, max(3, args.repeats), direct)
        results_list: list[Result] = []
        with tqdm(settings, desc="bench write", unit="setting", disable=None) as progress:
            for item_bytes, group in itertools.groupby(settings, key=lambda s: s.item_bytes):
                state = _state(nbytes, item_bytes)
                gc.collect()
                gc.freeze()
                for setting in group:
                    progress.set_postfix_str(setting.label())
                    results_list.append(uvloop.run(_measure(setting, state, nbytes, base,
                                                            args.repeats)))
                    progress.update(1)
                gc.unfreeze()
                del state
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(f"\nstorage {args.target} ({'O_DIRECT ok' if direct else 'no O_DIRECT'}), "
          f"{_size(nbytes)} per save, medians of {args.repeats}")
    for name, speed in baselines.items():
        print(f"  {name:<40}{speed:>7.2f} GB/s")
    print(f"{'bins':>5}{'threads':>8}{'items':>9}{'mode':>10}{'GB/s':>8}{'x raw':>8}"
          f"{'loop ms':>9}")
    raw = baselines["raw pwrite+fsync (1 thread)"]
    for r in results_list:
        s = r.setting
        print(f"{s.num_bins:>5}{s.num_workers:>8}{_size(s.item_bytes):>9}"
              f"{'O_DIRECT' if s.direct_io else 'buffered':>10}{r.median_gb_per_s:>8.2f}"
              f"{r.median_gb_per_s / raw:>7.2f}x{r.worst_loop_delay_ms:>9.1f}")
    c = recommend(results_list, args.max_loop_delay_ms)
    summary = {"target": args.target, "nbytes": nbytes, "direct_io_available": direct,
               "baselines_gb_per_s": baselines,
               "results": [{**asdict(r.setting), "median_gb_per_s": r.median_gb_per_s,
                            "samples_s": r.samples_s,
                            "worst_loop_delay_ms": r.worst_loop_delay_ms} for r in results_list],
               "recommended": asdict(c),
               "meta": _results.run_meta(started, args, torch=torch.__version__)}
    path = _results.write_results("write_sweep", summary, out=args.out)
    picture = os.path.splitext(path)[0] + ".png"
    try:
        plot(results_list, baselines, picture, f"asynctron save sweep on {args.target}")
    except ModuleNotFoundError as exc:
        print(f"plot: skipped, {exc.name!r} is not installed (`pip install asynctron[bench]`)")
    else:
        print(f"plot: {picture}")
    print(f"\nrecommended for this storage: Engine(num_workers={c.num_workers}, "
          f"num_bins={c.num_bins}, direct_io={c.direct_io}): {c.mean_gb_per_s:.2f} GB/s "
          f"(geometric mean over item sizes, {c.mean_gb_per_s / raw:.2f}x the raw 1-thread "
          f"baseline), loop worst {c.worst_loop_delay_ms:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
