"""Many small tensors: a state dict of 100k tensors of 4 floats (one optimizer entry per
parameter), saved by asynctron and its peers in one process, durable (fsync) each.

Methods, taking turns each round after an untimed warm-up round: asynctron with a warm engine
(its plan cached, as a trainer's repeated saves find it), asynctron's first save of this
structure (a fresh Engine: planned afresh), durable `torch.save`, `safetensors` (flat keys),
and (one round, it takes tens of seconds) `dcp.save` with 4 threads. Reported: medians, the
loop's worst heartbeat delay during asynctron's saves, and loads (asynctron, `torch.load`).

Run: `asynctron bench many`; `--quick` for a smoke run.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
import uvloop

from asynctron import Engine
from asynctron.bench import _peers, _results
from asynctron.bench._rounds import round_order
from asynctron.testing import LoopWatchdog

OURS = "asynctron (warm engine)"
FIRST = "asynctron (first save, fresh Engine)"


def make_state(num_tensors: int) -> dict[str, Any]:
    """An optimizer-like state: `num_tensors` tensors of 4 floats, two per parameter."""
    return {"optim": {"state": {i: {"exp_avg": torch.full((4,), float(i)),
                                    "exp_avg_sq": torch.full((4,), float(-i))}
                                for i in range(num_tensors // 2)}}, "step": 100}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench many",
                                     description=_results.description(__doc__))
    parser.add_argument("--num-tensors", type=int, default=100_000)
    parser.add_argument("--target", default="/dev/shm", help="directory to save into")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_tensors, args.repeats = 2000, 1
    started = time.time()
    state = make_state(args.num_tensors)
    flat = {f"optim.state.{i}.{name}": tensor  # safetensors takes flat string keys only
            for i, entry in state["optim"]["state"].items() for name, tensor in entry.items()}
    gc.collect()
    base = _results.scratch_dir(f"asynctron-bench-{os.getpid()}-", args.target)
    loop = uvloop.new_event_loop()
    engine = Engine()
    loop.run_until_complete(engine.start())
    timings: dict[str, list[float]] = {}
    delays: dict[str, list[float]] = {}

    def ours(path: str, fresh: bool) -> None:
        async def run() -> None:
            async with LoopWatchdog() as dog:
                if fresh:
                    async with Engine() as first:
                        await first.save(state, path)
                else:
                    await engine.save(state, path)
            delays.setdefault(FIRST if fresh else OURS, []).append(dog.report().worst_delay_s)

        loop.run_until_complete(run())

    methods: dict[str, Callable[[str], None]] = {
        OURS: lambda path: ours(path, fresh=False),
        FIRST: lambda path: ours(path, fresh=True),
        "torch.save": lambda path: _peers.save_torch(state, path),
        "safetensors": lambda path: _peers.save_safetensors(flat, path),
    }
    try:
        names = list(methods)
        for round_index in range(args.repeats + 1):
            for name in round_order(names, round_index):
                path = os.path.join(base, f"{round_index}-{names.index(name)}")
                gc.collect()
                start = time.perf_counter()
                methods[name](path)
                elapsed = time.perf_counter() - start
                if round_index:
                    timings.setdefault(name, []).append(elapsed)
                else:  # the warm-up round's delays are not measured
                    delays.clear()
                print(f"  round {round_index} {name:<40} {elapsed:7.3f} s", flush=True)
        if not args.quick:
            path = os.path.join(base, "dcp")
            start = time.perf_counter()
            _peers.save_dcp(state, path, 4)
            timings["dcp (4 threads), one round"] = [time.perf_counter() - start]
        keep = os.path.join(base, f"{args.repeats}-{names.index(OURS)}")
        torch_file = os.path.join(base, f"{args.repeats}-{names.index('torch.save')}")
        for _ in range(args.repeats):
            start = time.perf_counter()
            loop.run_until_complete(engine.load(keep))
            timings.setdefault("load: asynctron", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.load(torch_file, weights_only=True)
            timings.setdefault("load: torch.load", []).append(time.perf_counter() - start)
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()
        shutil.rmtree(base, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    print(f"\n== {args.num_tensors} tensors of 4 floats ==")
    for name, median in sorted(medians.items(), key=lambda kv: kv[1]):
        print(f"{name:<44}{median:>9.3f} s")
    targets = [f"{OURS} vs durable torch.save: {medians['torch.save'] / medians[OURS]:.2f}x "
               "(target: >= 1, asynctron no slower)",
               f"loop worst delay over {OURS}: max {max(delays[OURS]) * 1e3:.1f} ms "
               "(target <= 50 ms); over first saves: max "
               f"{max(delays[FIRST]) * 1e3:.1f} ms"]
    for line in targets:
        print(line)
    results = {"num_tensors": args.num_tensors, "medians_s": medians, "samples_s": timings,
               "loop_worst_delay_s": delays, "targets": targets,
               "meta": _results.run_meta(started, args,
                                         memory_bytes=psutil.virtual_memory().total,
                                         peers=_peers.peer_versions())}
    _results.write_results("save_many", results, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
