"""Save/load benchmark: asynctron against its peers and the physical baselines, in one process.

For each target (/dev/shm and the disk under the working directory) and each state dict
(mixed sizes; one with a single large tensor), every method saves the same tensors, in
a shuffled order over several repeats after an untimed warm-up round; medians are reported
with ratios (a throughput ratio: above 1 means asynctron is faster). Guest memory is warmed
first (see `_baselines.warm_guest_memory`), so no method pays the VM's first-touch cost.

Measured as well: blocking time (`await task.staged`) against a raw memcpy, the loop's worst
heartbeat delay during asynctron's saves, the checksum's share of the save (asynctron with and
without checksums; crc32c and xxh3-64 speeds), peak RSS growth with a state 4x the memory
budget, cold load against a raw read, and mmap load time.

Also: a fresh Engine per save and the one-call `asynctron.save` against the durable peers, and
each method's first save in a fresh process (`first_save`, one process per save).

Run: `asynctron bench save`; `--quick` for a smoke run.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import torch
import uvloop

import asynctron
from asynctron import Engine
from asynctron.bench import _baselines, _peers, _results, first_save, save_ranks
from asynctron.bench._rounds import round_order
from asynctron.testing import LoopWatchdog

GiB = 1 << 30
MiB = 1 << 20
OURS = "asynctron"
IN_PLACE = "asynctron (in place)"
NO_CHECKSUM = "asynctron (no checksum)"
FRESH_ENGINE = "asynctron (fresh Engine)"
ONE_CALL = "asynctron.save"
RAW = "raw pwrite+fsync"
RAW_DIRECT = "raw O_DIRECT pwrite+fsync"
#: Peers whose semantics match `snapshot=False` (the caller waits for the whole save).
SYNC_PEERS = ("torch.save", "dcp (1 thread)", "dcp (2 threads)", "dcp (4 threads)",
              "safetensors")
ASYNC_PEERS = ("dcp async_save", "megatron FileSystemWriterAsync")


@dataclass
class Scenario:
    """One state dict on one target directory."""

    target: str
    label: str
    state: dict[str, torch.Tensor]
    nbytes: int
    timings: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def on_disk(self) -> bool:
        return not self.target.startswith("/dev/shm")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fresh(path: str) -> str:
    if os.path.lexists(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return path


#: Staging budget of the benchmark's engines: the 2 GiB state and one slab per bin fit (so
#: blocking is a copy); the 3.5 GiB state streams through it (so blocking waits for writes).
BUDGET_BYTES = 2 * GiB + 512 * MiB


class AsynctronRunner:
    """asynctron's saves on one uvloop loop; engines by setting, reused across rounds (as a
    trainer keeps its engine)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.engines: dict[str | None, Engine] = {}

    def engine(self, checksum: str | None = "xxh3_64") -> Engine:
        if checksum not in self.engines:
            engine = Engine(checksum=checksum, memory_budget_bytes=BUDGET_BYTES)
            self.loop.run_until_complete(engine.__aenter__())
            self.engines[checksum] = engine
        return self.engines[checksum]

    def save(self, scenario: Scenario, path: str, *, snapshot: bool = True,
             checksum: str | None = "xxh3_64") -> None:
        engine = self.engine(checksum)

        async def run() -> None:
            result = await engine.save(scenario.state, path, snapshot=snapshot)
            if snapshot and checksum is not None:
                scenario.samples.setdefault("staged_s", []).append(result.stage_s)

        self.loop.run_until_complete(run())

    def watch_loop(self, scenario: Scenario, path: str) -> None:
        """An untimed save under a 1 ms heartbeat, for the loop's worst delay (the heartbeat's
        thousand wake-ups a second take the GIL from the save's threads, so timed saves run
        without it)."""
        engine = self.engine()

        async def run() -> None:
            async with LoopWatchdog() as dog:
                await engine.save(scenario.state, path)
            scenario.samples.setdefault("loop_worst_delay_s", []).append(
                dog.report().worst_delay_s)

        self.loop.run_until_complete(run())

    def save_with_fresh_engine(self, scenario: Scenario, path: str) -> None:
        """A script's save: a new Engine for this one save (the process's staging cache is
        warm from earlier saves, as in any process that saved before)."""

        async def run() -> None:
            async with Engine(memory_budget_bytes=BUDGET_BYTES) as engine:
                await engine.save(scenario.state, path)

        self.loop.run_until_complete(run())

    def free_staging(self) -> None:
        asynctron.free_idle_staging()

    def close(self) -> None:
        for engine in self.engines.values():
            self.loop.run_until_complete(engine.aclose())


def _methods(ours: AsynctronRunner, scenario: Scenario, quick: bool,
             megatron: bool) -> dict[str, Callable[[str], None]]:
    """Each method saves the scenario's state to the path it is given (which does not exist)."""
    state = scenario.state
    buffers = _baselines.state_dict_buffers(state)
    methods: dict[str, Callable[[str], None]] = {
        RAW: lambda path: _baselines.raw_pwrite_fsync(buffers, path),
        OURS: lambda path: ours.save(scenario, path),
        IN_PLACE: lambda path: ours.save(scenario, path, snapshot=False),
        NO_CHECKSUM: lambda path: ours.save(scenario, path, checksum=None),
        FRESH_ENGINE: lambda path: ours.save_with_fresh_engine(scenario, path),
        ONE_CALL: lambda path: asynctron.save(state, path),
        "torch.save": lambda path: _peers.save_torch(state, path),
        "dcp (1 thread)": lambda path: _peers.save_dcp(state, path, 1),
        "dcp (2 threads)": lambda path: _peers.save_dcp(state, path, 2),
        "dcp (4 threads)": lambda path: _peers.save_dcp(state, path, 4),
        "dcp async_save": lambda path: _peers.save_dcp_async(state, path, 4),
        "safetensors": lambda path: _peers.save_safetensors(state, path),
    }
    if scenario.on_disk:
        methods[RAW_DIRECT] = lambda path: _baselines.raw_direct_pwrite_fsync(scenario.nbytes, path)
    if quick:
        for name in ("dcp (2 threads)", "dcp (4 threads)", "dcp async_save"):
            methods.pop(name)
    reason = _peers.megatron_available() if megatron else "skipped (--skip-megatron)"
    if reason is None:
        methods["megatron FileSystemWriterAsync"] = lambda path: _peers.save_megatron_async(
            state, path, thread_count=2)
    else:
        scenario.notes["megatron"] = f"not run: {reason}"
    return methods


_RUN_PREFIX = "asynctron-bench-"
_NPROC = argparse.ArgumentParser(add_help=False)
_NPROC.add_argument("--nproc", type=int, default=1)


def _remove_stale_runs(target: str) -> None:
    """Remove scratch dirs of earlier runs that died (killed runs leave GBs behind in RAM)."""
    for name in os.listdir(target):
        if name.startswith(_RUN_PREFIX):
            pid = name[len(_RUN_PREFIX):].split("-")[0]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                shutil.rmtree(os.path.join(target, name), ignore_errors=True)


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_saves(ours: AsynctronRunner, scenario: Scenario, repeats: int, quick: bool,
              megatron: bool) -> None:
    base = _results.scratch_dir(f"{_RUN_PREFIX}{os.getpid()}-", scenario.target)
    try:
        methods = _methods(ours, scenario, quick, megatron)
        names = list(methods)
        for round_index in range(repeats + 1):  # round 0 warms pages, caches and imports
            for name in round_order(names, round_index):
                path = _fresh(os.path.join(base, name.replace(" ", "_")))  # untimed
                os.sync()
                gc.collect()
                elapsed = _time(lambda method=methods[name], path=path: method(path))
                if name != OURS:  # RAM is finite: keep only asynctron's, for the loads
                    _fresh(path)
                if round_index > 0:
                    scenario.timings.setdefault(name, []).append(elapsed)
                print(f"  {scenario.label:<26} round {round_index} {name:<32} "
                      f"{scenario.nbytes / elapsed / 1e9:6.2f} GB/s", flush=True)
            if round_index == 0:
                scenario.samples.clear()
            else:
                ours.watch_loop(scenario, _fresh(os.path.join(base, "watched")))
                _fresh(os.path.join(base, "watched"))
        run_copies(scenario, repeats)
        run_loads(ours, scenario, os.path.join(base, OURS), repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_copies(scenario: Scenario, repeats: int) -> None:
    """The staging floor (one thread memcpy into pre-faulted memory) and hash speeds."""
    sources = _baselines.state_dict_buffers(scenario.state)
    destinations = _baselines.make_memcpy_destinations(sources)
    for _ in range(repeats):
        scenario.timings.setdefault("raw memcpy", []).append(
            _time(lambda: _baselines.raw_memcpy(sources, destinations)))
        for algorithm in ("crc32c", "xxh3_64"):
            scenario.timings.setdefault(f"{algorithm} (1 thread)", []).append(
                _time(lambda a=algorithm: _baselines.hash_all(sources, a)))


def run_loads(ours: AsynctronRunner, scenario: Scenario, checkpoint: str, repeats: int) -> None:
    """Cold loads (page cache evicted; on tmpfs the page cache is the storage): a raw read
    into fresh memory, as a load must produce, against `engine.load`; then mmap."""
    engine = ours.engine()
    files = sorted(os.path.join(checkpoint, n) for n in os.listdir(checkpoint)
                   if n.endswith(".distcp"))
    for _ in range(repeats):
        if scenario.on_disk:
            _baselines.evict_page_cache(files)
        start = time.perf_counter()
        buffers = [np.empty(os.path.getsize(path), dtype=np.uint8) for path in files]
        _baselines.raw_read(files, buffers)
        scenario.timings.setdefault("load: raw read", []).append(time.perf_counter() - start)
        del buffers
        if scenario.on_disk:
            _baselines.evict_page_cache(files)
        start = time.perf_counter()
        loaded = ours.loop.run_until_complete(engine.load(checkpoint))
        scenario.timings.setdefault("load: asynctron", []).append(time.perf_counter() - start)
        del loaded
        start = time.perf_counter()
        mapped = ours.loop.run_until_complete(engine.load(checkpoint, mmap=True))
        scenario.timings.setdefault("load: asynctron mmap", []).append(
            time.perf_counter() - start)
        del mapped
        gc.collect()


def run_budget(target: str, nbytes: int) -> dict[str, float]:
    """Peak RSS growth while saving a state 4x the memory budget (a fresh engine)."""
    state = _baselines.make_state_dict(nbytes, seed=7)
    budget = nbytes // 4
    process = psutil.Process()
    base = _results.scratch_dir(f"{_RUN_PREFIX}{os.getpid()}-", target)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.002)

    async def save() -> float:
        slab = max(4096, min(64 * MiB, budget // 8 // 4096 * 4096))
        async with Engine(memory_budget_bytes=budget, slab_bytes=slab) as engine:
            await engine.save(state, f"{base}/budget")
            return engine.budget.statistics().peak_borrowed_bytes

    gc.collect()
    before = process.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        peak_borrowed = uvloop.run(save())
    finally:
        stop.set()
        sampler.join()
        shutil.rmtree(base, ignore_errors=True)
    return {"state_bytes": nbytes, "budget_bytes": budget, "rss_growth_bytes": peak - before,
            "peak_borrowed_bytes": peak_borrowed}


def _targets(s: Scenario, saves: dict[str, float], budget_bytes: int) -> list[str]:
    """The issue's targets for one scenario, each with its measured figure."""
    ours = saves[OURS]
    peers = {n: saves[n] for n in (*SYNC_PEERS, *ASYNC_PEERS) if n in saves}
    best_name = min(peers, key=peers.get) if peers else None
    staged = _median(s.samples.get("staged_s", []))
    memcpy = _median(s.timings["raw memcpy"])
    delays = s.samples.get("loop_worst_delay_s", [float("nan")])
    lines = [f"save vs {RAW}: {saves[RAW] / ours:.2f}x (target >= 0.9x on disk)"]
    if RAW_DIRECT in saves:
        lines.append(f"save vs {RAW_DIRECT} (device ceiling): {saves[RAW_DIRECT] / ours:.2f}x")
    if best_name is not None:
        lines.append(f"warm snapshot save vs fastest peer ({best_name}): "
                     f"{peers[best_name] / ours:.2f}x (target: ahead, > 1); in place vs it: "
                     f"{peers[best_name] / saves[IN_PLACE]:.2f}x")
    durable = {n: saves[n] for n in SYNC_PEERS if n in saves}
    if durable:
        fastest = min(durable, key=durable.get)
        for name in (FRESH_ENGINE, ONE_CALL):
            lines.append(f"{name} vs the fastest durable peer ({fastest}): "
                         f"{durable[fastest] / saves[name]:.2f}x (target: ahead, > 1)")
    fits = s.nbytes <= budget_bytes
    lines.append(f"blocking (await staged) {staged:.3f} s vs raw memcpy {memcpy:.3f} s: "
                 f"{staged / memcpy:.2f}x (target <= 1.5x)"
                 + ("" if fits else f"; the state exceeds the {budget_bytes / GiB:.1f} GiB "
                    "staging budget, so staging waits for writes"))
    lines.append(f"loop worst heartbeat delay over asynctron's saves: median "
                 f"{_median(delays) * 1e3:.1f} ms, max {max(delays) * 1e3:.1f} ms "
                 "(target <= 10 ms)")
    lines.append(f"checksum cost: {(ours - saves[NO_CHECKSUM]) / ours:+.1%} of the save "
                 f"(xxh3-64, hashed by the writers; target <= 10%)")
    return lines


def run_first_saves(targets: list[str], size_gib: float, repeats: int, methods: Sequence[str]
                    ) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Each of `methods`' first save in a fresh process (`first_save`), `repeats` processes
    per method and target, methods taking turns."""
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    for target in targets:
        kind = "disk" if not target.startswith("/dev/shm") else "shm"
        by_method = results.setdefault(kind, {})
        for round_index in range(repeats):
            for method in methods:
                done = subprocess.run(
                    [sys.executable, "-m", "asynctron.bench.first_save", method, target,
                     "--size-gib", str(size_gib)], capture_output=True, text=True, check=True)
                timings = json.loads(done.stdout.strip().splitlines()[-1])
                for key, value in timings.items():
                    if key != "method":
                        by_method.setdefault(method, {}).setdefault(key, []).append(value)
                print(f"  first save, {kind}, round {round_index} {method:<24} blocking "
                      f"{timings['blocking_s']:.3f} s, total {timings['total_s']:.3f} s",
                      flush=True)
    return results


def report(scenarios: list[Scenario], budget: dict[str, float],
           budget_bytes: int) -> dict[str, Any]:
    """Print the tables and return the JSON-able results."""
    out: dict[str, Any] = {"scenarios": []}
    for s in scenarios:
        saves = {name: _median(v) for name, v in s.timings.items()
                 if not name.startswith(("load", "raw memcpy", "crc32c", "xxh3"))}
        ours, in_place = saves[OURS], saves[IN_PLACE]
        print(f"\n== {s.label}: {s.nbytes / GiB:.2f} GiB, {len(s.state)} tensors ==")
        print(f"{'method':<34}{'median s':>10}{'GB/s':>8}{'asynctron x':>13}{'in place x':>12}")
        for name, median in sorted(saves.items(), key=lambda kv: kv[1]):
            print(f"{name:<34}{median:>10.3f}{s.nbytes / median / 1e9:>8.2f}"
                  f"{median / ours:>12.2f}x{median / in_place:>11.2f}x")
        targets = _targets(s, saves, budget_bytes)
        for line in targets:
            print(line)
        hashes = {a: _median(s.timings[f"{a} (1 thread)"]) for a in ("crc32c", "xxh3_64")}
        print("hash of all bytes, 1 thread: " + ", ".join(
            f"{a} {t:.3f} s ({s.nbytes / t / GiB:.1f} GiB/s)" for a, t in hashes.items()))
        loads = {name: _median(v) for name, v in s.timings.items() if name.startswith("load")}
        print(f"load ({'cold' if s.on_disk else 'tmpfs'}): raw read {loads['load: raw read']:.3f}"
              f" s, asynctron {loads['load: asynctron']:.3f} s "
              f"({loads['load: raw read'] / loads['load: asynctron']:.2f}x raw; target >= "
              f"0.9x), mmap {loads['load: asynctron mmap'] * 1e3:.1f} ms")
        for key, note in s.notes.items():
            print(f"{key}: {note}")
        out["scenarios"].append({
            "label": s.label, "target": s.target, "nbytes": s.nbytes,
            "num_tensors": len(s.state), "on_disk": s.on_disk,
            "saves": {name: {"median_s": m, "gb_per_s": s.nbytes / m / 1e9,
                             "asynctron_speedup": m / ours,
                             "asynctron_in_place_speedup": m / in_place,
                             "samples_s": s.timings[name]} for name, m in saves.items()},
            "staged_s": s.samples.get("staged_s", []),
            "loop_worst_delay_s": s.samples.get("loop_worst_delay_s", []),
            "memcpy_s": s.timings["raw memcpy"], "hash_1thread_s": hashes,
            "loads_s": loads, "targets": targets, "notes": s.notes,
        })
    print(f"\nbudget: state {budget['state_bytes'] / MiB:.0f} MiB = 4x budget "
          f"{budget['budget_bytes'] / MiB:.0f} MiB; peak RSS growth "
          f"{budget['rss_growth_bytes'] / MiB:.0f} MiB (target <= budget + 256 MiB); "
          f"peak staging {budget['peak_borrowed_bytes'] / MiB:.0f} MiB")
    out["budget"] = budget
    return out


def report_first_saves(first: dict[str, dict[str, dict[str, list[float]]]],
                       size_gib: float) -> dict[str, Any]:
    """Print and return the medians of the first saves in fresh processes."""
    out: dict[str, Any] = {"size_gib": size_gib, "targets": {}}
    for kind, by_method in first.items():
        print(f"\n== first save in a fresh process, {kind}, {size_gib:g} GiB ==")
        print(f"{'method':<26}{'blocking s':>11}{'total s':>9}{'prefault s':>12}")
        medians = {method: {key: _median(values) for key, values in timings.items()}
                   for method, timings in by_method.items()}
        for method, m in sorted(medians.items(), key=lambda kv: kv[1]["total_s"]):
            prefault = f"{m['prefault_s']:.3f}" if "prefault_s" in m else "-"
            print(f"{method:<26}{m['blocking_s']:>11.3f}{m['total_s']:>9.3f}{prefault:>12}")
        out["targets"][kind] = {"medians": medians, "samples": by_method}
    return out


def main(argv: list[str] | None = None) -> int:
    ranks, _ = _NPROC.parse_known_args(argv)
    if ranks.nproc > 1:  # `asynctron bench save --nproc N`: the same job across N ranks
        return save_ranks.main(argv)
    parser = argparse.ArgumentParser(prog="asynctron bench save",
                                     description=_results.description(__doc__),
                                     epilog="With --nproc N > 1, see `python -m "
                                            "asynctron.bench.save_ranks --help`.")
    parser.add_argument("--size-gib", type=float, default=2.0, help="mixed state dict size")
    parser.add_argument("--large-gib", type=float, default=3.0,
                        help="size of the single large tensor (0: skip that state dict)")
    parser.add_argument("--targets", default=f"/dev/shm,{os.getcwd()}",
                        help="comma-separated directories to save into")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    parser.add_argument("--skip-megatron", action="store_true",
                        help="do not run Megatron's writer even where megatron-core imports")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.large_gib, args.repeats = 0.03, 0.02, 1
    targets = [t for t in args.targets.split(",") if t]
    started = time.time()
    warmed = 0 if args.quick else _baselines.warm_guest_memory()
    print(f"warmed {warmed / GiB:.1f} GiB of guest memory", flush=True)
    loop = uvloop.new_event_loop()
    ours = AsynctronRunner(loop)
    config = ours.engine().config
    budget_bytes = BUDGET_BYTES
    scenarios = []
    try:
        for target in targets:
            _remove_stale_runs(target)
        plans = [("mixed", int(args.size_gib * GiB), None, args.repeats)]
        if args.large_gib > 0:
            plans.append((f"{args.large_gib:g} GiB tensor",
                          int((0.25 * args.size_gib + args.large_gib) * GiB),
                          int(args.large_gib * GiB), max(1, args.repeats - 2)))
        for seed, (label, total_bytes, large_bytes, repeats) in enumerate(plans, start=1):
            state = _baselines.make_state_dict(total_bytes, seed=seed,
                                               large_tensor_bytes=large_bytes)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            for target in targets:
                kind = "disk" if not target.startswith("/dev/shm") else "shm"
                scenario = Scenario(target, f"{kind}: {label}", state, nbytes)
                run_saves(ours, scenario, repeats, args.quick, not args.skip_megatron)
                scenarios.append(scenario)
                ours.free_staging()
            del state
            gc.collect()
        budget = run_budget(targets[0], int(min(args.size_gib, 1.0) * GiB))
    finally:
        ours.close()
        loop.close()
    first = run_first_saves(targets, min(args.size_gib, 1.0), args.repeats,
                            first_save.QUICK_METHODS if args.quick else first_save.METHODS)
    results = report(scenarios, budget, budget_bytes)
    results["first_save"] = report_first_saves(first, min(args.size_gib, 1.0))
    results["meta"] = _results.run_meta(
        started, args, memory_bytes=psutil.virtual_memory().total, peers=_peers.peer_versions(),
        engine_config=repr(config), warmed_guest_memory_bytes=warmed)
    _results.write_results("save_throughput", results, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
