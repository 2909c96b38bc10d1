"""The first save in a fresh process: what a script (or a job's first checkpoint) pays before
any staging memory is warm. One method per process; `save_throughput` runs it per method and
repeat and reports the medians.

Methods: `asynctron` (an Engine, snapshot save: blocking is `await task.staged`),
`asynctron prefaulted` (the same after `engine.prefault_staging(state bytes)`, as a
trainer calls it at start-up, timed apart as `prefault_s`), `asynctron.save` (one call),
and the peers' durable saves (`torch.save`, `dcp (4 threads)`, `dcp async_save` (blocking:
until it returns), `safetensors`).

Run: `python -m asynctron.bench.first_save METHOD TARGET_DIR --size-gib N` (prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
import uvloop

METHODS = ("asynctron", "asynctron prefaulted", "asynctron.save", "torch.save",
           "dcp (4 threads)", "dcp async_save", "safetensors")
QUICK_METHODS = ("asynctron", "asynctron prefaulted", "asynctron.save", "torch.save")
"""A smoke run's (`bench save --quick`): each of our paths, and one peer (a fresh process each
costs ~4 s of imports)."""


def run(method: str, state: dict[str, torch.Tensor], path: str) -> dict[str, float]:
    """Time `method`'s first save of `state` to `path`: blocking, total (and prefault)."""
    import asynctron
    from asynctron.bench import _peers

    if method in ("asynctron", "asynctron prefaulted"):
        async def save() -> dict[str, float]:
            async with asynctron.Engine(memory_budget_bytes=(5 << 30) // 2) as engine:
                timings = {}
                if method == "asynctron prefaulted":
                    start = time.perf_counter()
                    await engine.prefault_staging(sum(t.nbytes for t in state.values()))
                    timings["prefault_s"] = time.perf_counter() - start
                start = time.perf_counter()
                task = engine.save(state, path)
                await task.staged
                timings["blocking_s"] = time.perf_counter() - start
                await task
                timings["total_s"] = time.perf_counter() - start
                return timings

        return uvloop.run(save())
    start = time.perf_counter()
    staged = start
    if method == "asynctron.save":
        asynctron.save(state, path)
    elif method == "torch.save":
        _peers.save_torch(state, path)
    elif method == "dcp (4 threads)":
        _peers.save_dcp(state, path, 4)
    elif method == "dcp async_save":
        future = _peers.DcpAsyncSaver(process=False, persistent_stager=False).start(state, path)
        staged = time.perf_counter()
        future.result()
    elif method == "safetensors":
        _peers.save_safetensors(state, path)
    else:
        raise ValueError(f"method: expected one of {METHODS}, found {method!r}")
    end = time.perf_counter()
    return {"blocking_s": (staged if method == "dcp async_save" else end) - start,
            "total_s": end - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("method", choices=METHODS)
    parser.add_argument("target", help="directory to save into")
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    from asynctron.bench import _baselines, _results

    state = _baselines.make_state_dict(int(args.size_gib * (1 << 30)), seed=args.seed)
    base = _results.scratch_dir(f"asynctron-bench-{os.getpid()}-", args.target)
    try:
        timings = run(args.method, state, os.path.join(base, "first"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"method": args.method, **timings}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
