"""Save/load benchmark: asynctron against its peers and the physical baselines, in one process.

For each target (/dev/shm and the disk under the working directory) and each state dict
(mixed sizes; one with a single large tensor), every method saves the same tensors, in
round-robin order over several repeats after an untimed warm-up round; medians are
reported, with ratios asynctron / peer and asynctron / raw baseline (a throughput ratio:
above 1 means asynctron is faster). Also measured: blocking time (`await task.staged`) vs a
raw memcpy, the loop's worst heartbeat delay, peak RSS growth with a state 4x the memory
budget, checksum cost, cold load vs a raw read, and mmap load time.

Run: `python -m bench.save_throughput` (or `asynctron bench save`); `--quick` for a smoke run.
Results: printed, and written as JSON to bench/results/save_throughput_<host>_<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import psutil
import torch
import uvloop

from asynctron import Engine
from asynctron.testing import LoopWatchdog
from bench import _peers, _results

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Scenario:
    """One state dict on one target directory."""

    target: str
    label: str
    state: dict[str, torch.Tensor]
    nbytes: int
    timings: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fresh(path: str) -> str:
    if os.path.lexists(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return path


def _asynctron_save(engine: Engine, loop: asyncio.AbstractEventLoop, state: dict, path: str,
                    record: dict[str, list[float]], snapshot: bool) -> None:
    async def run() -> None:
        async with LoopWatchdog() as dog:
            result = await engine.save(state, path, snapshot=snapshot)
        if snapshot:
            record.setdefault("asynctron.staged", []).append(result.stage_s)
        record.setdefault("asynctron.loop_worst_delay", []).append(dog.report().worst_delay_s)

    loop.run_until_complete(run())


def _methods(engine: Engine, loop: asyncio.AbstractEventLoop, scenario: Scenario,
             base: str, quick: bool, megatron: bool) -> dict[str, Callable[[], None]]:
    state = scenario.state
    buffers = _peers.state_dict_buffers(state)
    record = scenario.extra.setdefault("samples", {})
    methods: dict[str, Callable[[], None]] = {
        "raw pwrite+fsync": lambda: _peers.raw_pwrite_fsync(buffers, _fresh(f"{base}/raw.bin")),
        "asynctron": lambda: _asynctron_save(engine, loop, state, _fresh(f"{base}/asynctron"),
                                             record, snapshot=True),
        "asynctron (in place)": lambda: _asynctron_save(
            engine, loop, state, _fresh(f"{base}/asynctron-in-place"), record, snapshot=False),
        "torch.save": lambda: _peers.save_torch(state, _fresh(f"{base}/torch.pt")),
        "dcp (1 thread)": lambda: _peers.save_dcp(state, _fresh(f"{base}/dcp1"), 1),
        "dcp (4 threads)": lambda: _peers.save_dcp(state, _fresh(f"{base}/dcp4"), 4),
        "dcp async_save": lambda: _peers.save_dcp_async(state, _fresh(f"{base}/dcpa"), 4),
        "safetensors": lambda: _peers.save_safetensors(state, _fresh(f"{base}/st.safetensors")),
    }
    if quick:
        for name in ("dcp (4 threads)", "dcp async_save"):
            methods.pop(name)
    reason = _peers.megatron_available() if megatron else "skipped (--skip-megatron)"
    if reason is None:
        methods["megatron FileSystemWriterAsync"] = lambda: _peers.save_megatron_async(
            state, _fresh(f"{base}/mcore"), thread_count=2)
    else:
        scenario.extra["megatron"] = f"not run: {reason}"
    return methods


_RUN_PREFIX = "asynctron-bench-"


def _remove_stale_runs(target: str) -> None:
    """Remove scratch dirs of earlier runs that died (killed runs leave GBs behind in RAM)."""
    for name in os.listdir(target):
        if name.startswith(_RUN_PREFIX):
            pid = name[len(_RUN_PREFIX):].split("-")[0]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                shutil.rmtree(os.path.join(target, name), ignore_errors=True)


def run_saves(engine: Engine, loop: asyncio.AbstractEventLoop, scenario: Scenario,
              repeats: int, quick: bool, megatron: bool) -> None:
    base = tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-", dir=scenario.target)
    scenario.extra["num_tensors"] = len(scenario.state)
    try:
        methods = _methods(engine, loop, scenario, base, quick, megatron)
        for round_index in range(repeats + 1):  # round 0 warms pages, caches and imports
            for name, method in methods.items():
                os.sync()
                gc.collect()
                start = time.perf_counter()
                method()
                elapsed = time.perf_counter() - start
                for leftover in os.listdir(base):  # RAM is finite: keep only asynctron's
                    if leftover != "asynctron":
                        _fresh(os.path.join(base, leftover))
                if round_index > 0:
                    scenario.timings.setdefault(name, []).append(elapsed)
                print(f"  {scenario.label:<28} round {round_index} {name:<32} "
                      f"{scenario.nbytes / elapsed / 1e9:6.2f} GB/s", flush=True)
            if round_index == 0:
                scenario.extra["samples"].clear()
        sources = _peers.state_dict_buffers(scenario.state)
        destinations = _peers.make_memcpy_destinations(sources)
        memcpy = []
        for _ in range(repeats):
            start = time.perf_counter()
            _peers.raw_memcpy(sources, destinations)
            memcpy.append(time.perf_counter() - start)
        scenario.timings["raw memcpy"] = memcpy
        crc = []
        for _ in range(repeats):
            start = time.perf_counter()
            for buffer in sources:
                crc32c.crc32c(buffer)
            crc.append(time.perf_counter() - start)
        scenario.timings["crc32c (1 thread)"] = crc
        run_loads(engine, loop, scenario, f"{base}/asynctron", repeats)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_loads(engine: Engine, loop: asyncio.AbstractEventLoop, scenario: Scenario,
              checkpoint: str, repeats: int) -> None:
    files = sorted(os.path.join(checkpoint, n) for n in os.listdir(checkpoint)
                   if n.endswith(".distcp"))
    cold = "/dev/shm" not in scenario.target
    for _ in range(repeats):
        if cold:
            _peers.evict_page_cache(files)
        buffers = _peers.make_read_buffers(files)  # pre-faulted: pure I/O
        start = time.perf_counter()
        _peers.raw_read(files, buffers)
        scenario.timings.setdefault("load: raw read (pre-faulted buffers)", []).append(
            time.perf_counter() - start)
        del buffers
        if cold:
            _peers.evict_page_cache(files)
        start = time.perf_counter()  # fresh memory, as a load must produce: the fair baseline
        buffers = [np.empty(os.path.getsize(path), dtype=np.uint8) for path in files]
        _peers.raw_read(files, buffers)
        scenario.timings.setdefault("load: raw read", []).append(time.perf_counter() - start)
        del buffers
        if cold:
            _peers.evict_page_cache(files)
        start = time.perf_counter()
        loaded = loop.run_until_complete(engine.load(checkpoint))
        scenario.timings.setdefault("load: asynctron", []).append(time.perf_counter() - start)
        del loaded
        start = time.perf_counter()
        mapped = loop.run_until_complete(engine.load(checkpoint, mmap=True))
        scenario.timings.setdefault("load: asynctron mmap", []).append(
            time.perf_counter() - start)
        del mapped
        gc.collect()
    scenario.extra["load_cold"] = cold


def run_budget(target: str, nbytes: int) -> dict[str, float]:
    """Peak RSS growth while saving a state 4x the memory budget (a fresh engine)."""
    state = _peers.make_state_dict(nbytes, seed=7)
    budget = nbytes // 4
    process = psutil.Process()
    base = tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-", dir=target)
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


def report(scenarios: list[Scenario], budget: dict[str, float]) -> dict[str, Any]:
    """Print the tables and return the JSON-able results."""
    out: dict[str, Any] = {"scenarios": []}
    for s in scenarios:
        ours = _median(s.timings["asynctron"])
        in_place = _median(s.timings["asynctron (in place)"])
        print(f"\n== {s.label}: {s.nbytes / GiB:.2f} GiB, {s.extra['num_tensors']} tensors ==")
        print(f"{'method':<34}{'median s':>10}{'GB/s':>8}{'asynctron/it':>14}"
              f"{'in place/it':>13}")
        rows = {}
        for name, values in s.timings.items():
            if name.startswith(("load", "raw memcpy", "crc32c")):
                continue
            median = _median(values)
            rows[name] = {"median_s": median, "gb_per_s": s.nbytes / median / 1e9,
                          "asynctron_speedup": median / ours,
                          "asynctron_in_place_speedup": median / in_place, "samples_s": values}
            print(f"{name:<34}{median:>10.3f}{s.nbytes / median / 1e9:>8.2f}"
                  f"{median / ours:>13.2f}x{median / in_place:>12.2f}x")
        samples = s.extra.get("samples", {})
        staged = _median(samples.get("asynctron.staged", []))
        memcpy = _median(s.timings["raw memcpy"])
        worst = max(samples.get("asynctron.loop_worst_delay", [float("nan")]))
        crc = _median(s.timings["crc32c (1 thread)"])
        loads = {name: _median(v) for name, v in s.timings.items() if name.startswith("load")}
        print(f"blocking (await staged) {staged:.3f} s vs raw memcpy {memcpy:.3f} s: "
              f"{staged / memcpy:.2f}x")
        print(f"loop worst heartbeat delay during saves: {worst * 1e3:.2f} ms")
        print(f"crc32c of all bytes, 1 thread: {crc:.3f} s = {crc / ours:.1%} of the save")
        print(f"load ({'cold' if s.extra.get('load_cold') else 'page cache'}): raw read into "
              f"fresh memory {loads['load: raw read']:.3f} s (pre-faulted "
              f"{loads['load: raw read (pre-faulted buffers)']:.3f} s), asynctron "
              f"{loads['load: asynctron']:.3f} s "
              f"({loads['load: raw read'] / loads['load: asynctron']:.2f}x raw), "
              f"mmap {loads['load: asynctron mmap'] * 1e3:.1f} ms")
        if "megatron" in s.extra:
            print(f"megatron: {s.extra['megatron']}")
        out["scenarios"].append({
            "label": s.label, "target": s.target, "nbytes": s.nbytes,
            "num_tensors": s.extra["num_tensors"], "saves": rows, "staged_s": staged,
            "memcpy_s": memcpy,
            "blocking_vs_memcpy": staged / memcpy, "loop_worst_delay_s": worst,
            "crc32c_1thread_s": crc, "loads_s": loads, "load_cold": s.extra.get("load_cold"),
            "notes": {k: v for k, v in s.extra.items() if k == "megatron"},
        })
    print(f"\nbudget: state {budget['state_bytes'] / MiB:.0f} MiB = 4x budget "
          f"{budget['budget_bytes'] / MiB:.0f} MiB; peak RSS growth "
          f"{budget['rss_growth_bytes'] / MiB:.0f} MiB (target <= budget + 256 MiB); "
          f"peak staging {budget['peak_borrowed_bytes'] / MiB:.0f} MiB")
    out["budget"] = budget
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench save", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="mixed state dict size")
    parser.add_argument("--large-gib", type=float, default=3.0,
                        help="size of the single large tensor (0: skip that state dict)")
    parser.add_argument("--targets", default=f"/dev/shm,{os.getcwd()}",
                        help="comma-separated directories to save into")
    _results.add_common_arguments(
        parser, repeats=5,
        skip_megatron_help="do not run Megatron's writer even where megatron-core imports")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.large_gib, args.repeats = 0.03, 0.02, 1
    targets = [t for t in args.targets.split(",") if t]
    loop = uvloop.new_event_loop()
    engine = Engine()
    loop.run_until_complete(engine.__aenter__())
    scenarios = []
    started = time.time()
    try:
        for target in targets:
            _remove_stale_runs(target)
        plans = [("mixed", int(args.size_gib * GiB), None, args.repeats)]
        if args.large_gib > 0:
            plans.append((f"{args.large_gib:g} GiB tensor",
                          int((0.25 * args.size_gib + args.large_gib) * GiB),
                          int(args.large_gib * GiB), max(1, args.repeats - 2)))
        for seed, (label, total_bytes, large_bytes, repeats) in enumerate(plans, start=1):
            state = _peers.make_state_dict(total_bytes, seed=seed, large_tensor_bytes=large_bytes)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            for target in targets:
                kind = "shm" if target.startswith("/dev/shm") else "disk"
                scenario = Scenario(target, f"{kind}: {label}", state, nbytes)
                run_saves(engine, loop, scenario, repeats, args.quick, not args.skip_megatron)
                scenarios.append(scenario)
                engine.free_idle_staging()
            for scenario in scenarios:
                scenario.state = {}  # keep the figures, free the tensors
            del state
            gc.collect()
        budget = run_budget(targets[0], int(min(args.size_gib, 1.0) * GiB))
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()
    results = report(scenarios, budget)
    results["meta"] = {**_results.machine_record(started, args),
                       "peers": _peers.peer_versions(), "engine_config": repr(engine.config)}
    _results.write_results(results, "save_throughput", args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
