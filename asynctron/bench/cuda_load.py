"""GPU load benchmark (`asynctron bench cuda --mode load`): reading a checkpoint into GPU tensors
in place, warm (page cache) and cold (evicted first), in one process, on the same state, by
asynctron, its DCP plugin, stock `dcp.load` and a raw pread baseline.

- `raw pread + H2D`: the physical baseline; one thread preads asynctron's data files into
  pinned buffers, then one device copy per file;
- `asynctron load_into`: `BackgroundEngine.load_into(gpu_state, path)` (checksums verified, as
  by default);
- `asynctron.dcp.StorageReader`: stock `dcp.load(gpu_state, storage_reader=...)` through
  asynctron's plugin, of a checkpoint its `StorageWriter` wrote;
- `stock dcp.load`: `dcp.load` with `FileSystemReader`, of a checkpoint stock
  `FileSystemWriter` wrote.
Every target is checked bit-exact after the warm-up round. Targets (issue 30): asynctron and its
plugin >= 0.9x the raw baseline, warm and cold; the plugin >= 1.0x stock `dcp.load` and >= 0.9x
`load_into`. On a tmpfs target nothing can be evicted: only warm reads are measured.

`--device cpu` runs the same code on the CPU (a smoke test of the benchmark); without
`--device` and without CUDA it says so and exits 0.

Run: `asynctron bench cuda --mode load`; `--quick` for a smoke run.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/), also after each
timed round (a run stopped by a time budget keeps the rounds it finished).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import asynctron.dcp
from asynctron import BackgroundEngine
from asynctron.bench import _baselines, _results
from asynctron.bench._rounds import round_order
from asynctron.bench.cuda_staging import make_state

GiB = 1 << 30
MiB = 1 << 20
RAW = "raw pread + H2D"
OURS = "asynctron load_into"
PLUGIN = "asynctron.dcp.StorageReader"
STOCK = "stock dcp.load"
METHODS = (RAW, OURS, PLUGIN, STOCK)
#: ratio name -> (baseline method, method, target): baseline time / method time >= target
TARGETS = {"ours_vs_raw": (RAW, OURS, 0.9), "plugin_vs_raw": (RAW, PLUGIN, 0.9),
           "plugin_vs_stock": (STOCK, PLUGIN, 1.0), "plugin_vs_ours": (OURS, PLUGIN, 0.9)}
_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}


def filesystem_type(path: str) -> str:
    """The type of the filesystem `path` is on (from /proc/mounts; "unknown" without it)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                mount = fields[1]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


class Checkpoints:
    """The state saved three ways under `base` (asynctron, its DCP plugin, stock DCP), and a
    call per method that reads its checkpoint into `target` and waits for the device."""

    def __init__(self, engine: BackgroundEngine, state: dict[str, torch.Tensor],
                 target: dict[str, torch.Tensor], base: str) -> None:
        import torch.distributed.checkpoint as dcp

        self.paths = {name: os.path.join(base, f"ckpt{i}") for i, name in enumerate(METHODS)}
        self.paths[RAW] = self.paths[OURS]  # the baseline reads asynctron's data files
        result = engine.save(state, self.paths[OURS]).result()
        self.files = [os.path.join(result.path, name) for name in result.files]
        dcp.save(state, storage_writer=asynctron.dcp.StorageWriter(self.paths[PLUGIN]))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(self.paths[STOCK], thread_count=4,
                                                            sync_files=True))
        device = next(iter(state.values())).device
        sizes = [os.path.getsize(path) for path in self.files]
        pin = device.type == "cuda"
        self._host = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes]
        self._device_buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        self._engine = engine
        self._target = target
        self._device = device

    def reads(self) -> dict[str, Callable[[], None]]:
        import torch.distributed.checkpoint as dcp

        def raw() -> None:
            _baselines.raw_read(self.files, [t.numpy() for t in self._host])
            for host, device_buffer in zip(self._host, self._device_buffers, strict=True):
                device_buffer.copy_(host, non_blocking=True)

        def ours() -> None:
            self._engine.load_into(self._target, self.paths[OURS])

        def plugin() -> None:
            dcp.load(self._target, storage_reader=asynctron.dcp.StorageReader(self.paths[PLUGIN]))

        def stock() -> None:
            dcp.load(self._target, storage_reader=dcp.FileSystemReader(self.paths[STOCK]))

        def synchronized(read: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                read()
                if self._device.type == "cuda":
                    torch.cuda.synchronize(self._device)
            return run

        return {name: synchronized(read) for name, read in
                ((RAW, raw), (OURS, ours), (PLUGIN, plugin), (STOCK, stock))}


Samples = dict[str, dict[str, list[float]]]


def measure(checkpoints: Checkpoints, state: dict[str, torch.Tensor],
            target: dict[str, torch.Tensor], *, repeats: int, cold: bool,
            on_round: Callable[[Samples, dict[str, bool]], None]
            ) -> tuple[Samples, dict[str, bool]]:
    """Per cache state ("cold" if `cold`, "warm") and method, the seconds of each timed round;
    and per method (not the baseline) whether the warm-up round's read was bit-exact.
    `on_round(samples, exact)` after each timed round (a run cut short keeps those)."""
    reads = checkpoints.reads()
    caches = ("cold", "warm") if cold else ("warm",)
    samples: Samples = {c: {m: [] for m in METHODS} for c in caches}
    exact: dict[str, bool] = {}
    for round_index in range(repeats + 1):  # round 0 warms every method
        for method in round_order(METHODS, round_index):
            if round_index == 0 and method != RAW:
                for tensor in target.values():
                    tensor.zero_()
            for cache in caches:
                if cache == "cold":
                    _baselines.evict_page_cache([checkpoints.paths[method]])
                started = time.perf_counter()
                reads[method]()
                if round_index:
                    samples[cache][method].append(time.perf_counter() - started)
            if round_index == 0 and method != RAW:
                exact[method] = all(torch.equal(target[k], state[k]) for k in state)
        if round_index:
            on_round(samples, exact)
    return samples, exact


def summarize(samples: Samples, nbytes: int) -> dict[str, Any]:
    """Medians, GB/s and the issue's ratios (baseline time / method time) per cache state."""
    medians = {cache: {m: statistics.median(v) for m, v in by.items()}
               for cache, by in samples.items()}
    return {
        "medians_s": medians,
        "gb_per_s": {cache: {m: nbytes / s / 1e9 for m, s in by.items()}
                     for cache, by in medians.items()},
        "ratios": {cache: {name: by[base] / by[method]
                           for name, (base, method, _target) in TARGETS.items()}
                   for cache, by in medians.items()},
        "samples": samples,
    }


def report(result: dict[str, Any]) -> list[str]:
    lines = [f"{result['device']}: {result['nbytes'] / GiB:.2f} GiB in {result['num_tensors']} "
             f"tensors, read from {result['target']} ({result['filesystem']})"]
    for cache, by in result["medians_s"].items():
        for method, seconds in by.items():
            lines.append(f"  {cache:<5}{method:<30}{seconds:>9.3f} s"
                         f"{result['gb_per_s'][cache][method]:>8.2f} GB/s")
        for name, (base, method, target) in TARGETS.items():
            ratio = result["ratios"][cache][name]
            lines.append(f"  {cache:<5}{method} vs {base}: {ratio:.2f}x (target >= {target}x)")
    lines.append("bit-exact: " + ", ".join(f"{m} {'yes' if ok else 'NO'}"
                                           for m, ok in result["bit_exact"].items()))
    lines += [f"not measured: {note}" for note in result["notes"]]
    for line in lines:
        print(line, flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench cuda --mode load",
                                     description=_results.description(__doc__))
    parser.add_argument("--device", default=None,
                        help="cuda (default where there is one) or cpu (a smoke run)")
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", default=os.path.join(os.getcwd(), "asynctron-bench-tmp"),
                        help="directory to save into and read from (default: on the working "
                             "directory's disk; a tmpfs measures warm reads only)")
    parser.add_argument("--quick", action="store_true", help="a few MiB, one round (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.tensors, args.repeats = 8 * MiB / GiB, 16, 1
    if args.device is None and not torch.cuda.is_available():
        print("asynctron bench cuda --mode load: no CUDA device; nothing to measure "
              "(--device cpu runs the same reads into CPU tensors)")
        return 0
    device = torch.device(args.device or "cuda")
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    started = time.time()
    state = make_state(int(args.size_gib * GiB), device, args.tensors)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    nbytes = sum(t.nbytes for t in state.values())
    base = _results.scratch_dir(f"asynctron-cuda-load-{os.getpid()}-", args.target)
    filesystem = filesystem_type(base)
    cold = filesystem not in _MEMORY_FILESYSTEMS
    budget = (nbytes // (64 * MiB) + 2) * 64 * MiB
    path = _results.results_path("cuda_load", args.out)

    def result_of(samples: Samples, exact: dict[str, bool]) -> dict[str, Any]:
        return {"device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu"),
                "nbytes": nbytes, "num_tensors": len(state), "target": args.target,
                "filesystem": filesystem, **summarize(samples, nbytes), "bit_exact": exact,
                "notes": [] if cold else [f"cold reads: {args.target} is {filesystem}, its "
                                          "pages cannot be evicted"],
                "meta": _results.run_meta(started, args, torch=torch.__version__)}

    def write(result: dict[str, Any]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        with BackgroundEngine(memory_budget_bytes=budget,
                              pin_memory=device.type == "cuda") as engine:
            checkpoints = Checkpoints(engine, state, target, base)
            samples, exact = measure(checkpoints, state, target, repeats=args.repeats,
                                     cold=cold, on_round=lambda s, e: write(result_of(s, e)))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = result_of(samples, exact)
    result["lines"] = report(result)
    write(result)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
