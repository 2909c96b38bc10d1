"""Save across ranks: asynctron against stock torch.distributed.checkpoint `save` and
`async_save`, on the same spawned gloo ranks, the same state and the same storage, in one run.

Every rank holds its own share of the state (as FSDP shards are: `--size-gib` in all, mixed
tensor sizes). Each method saves it in turn, round after round after an untimed warm-up; a
round's time is the slowest rank's, between barriers, so the figure is the aggregate
throughput a job sees. Also reported: each rank's blocking time (`await task.staged`; the time
`async_save` takes to return), asynctron's planning time without and with the cached plan
(seed 002), and the loop's worst heartbeat delay during asynctron's saves. The physical
baseline: every rank writes its bytes with one large pwrite+fsync loop, at the same time.

Run: `asynctron bench save --nproc 2`; `--quick`
for a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import uvloop

from asynctron import Engine
from asynctron._launch import run_local_ranks
from asynctron.bench import _baselines, _peers, _results
from asynctron.testing import LoopWatchdog

GiB = 1 << 30
OURS = "asynctron"
IN_PLACE = "asynctron (in place)"
RAW = "raw pwrite+fsync (every rank)"
PEERS = ("dcp.save", "dcp.async_save")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _rank_state(rank: int, nbytes: int) -> dict[str, torch.Tensor]:
    state = _baselines.make_state_dict(nbytes, seed=100 + rank)
    return {f"rank{rank}.{key}": tensor for key, tensor in state.items()}


def _rank(rank: int, world: int, args: argparse.Namespace, base: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    state = _rank_state(rank, int(args.size_gib * GiB) // world)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buffers = _baselines.state_dict_buffers(state)
    samples: dict[str, list[float]] = {}
    times: dict[str, list[float]] = {}

    def fresh(name: str) -> str:
        """A path for `name` this round, with the last round's output gone (untimed)."""
        path = os.path.join(base, name)
        if rank == 0 and os.path.exists(path):
            shutil.rmtree(path)
        dist.barrier()
        return path

    def raw(path: str) -> None:
        os.makedirs(path, exist_ok=True)
        _baselines.raw_pwrite_fsync(buffers, os.path.join(path, f"rank{rank}.bin"))

    def dcp_async(path: str) -> None:
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=path)
        samples.setdefault("dcp_async_blocking_s", []).append(time.perf_counter() - started)
        future.result()

    async def run() -> None:
        async with Engine(coordination_timeout_s=600) as engine:
            async def ours(path: str, snapshot: bool) -> None:
                async with LoopWatchdog() as dog:
                    result = await engine.save(state, path, snapshot=snapshot)
                if snapshot:
                    samples.setdefault("staged_s", []).append(result.stage_s)
                    samples.setdefault("plan_s", []).append(result.plan_s)
                    samples.setdefault("loop_worst_delay_s", []).append(
                        dog.report().worst_delay_s)

            methods: dict[str, Callable[[str], Any]] = {
                RAW: raw,
                OURS: lambda path: ours(path, True),
                IN_PLACE: lambda path: ours(path, False),
                "dcp.save": lambda path: dcp.save(state, checkpoint_id=path),
                "dcp.async_save": dcp_async,
            }
            for round_index in range(args.repeats + 1):  # round 0 warms pages and caches
                for name, method in methods.items():
                    path = fresh(name)
                    started = time.perf_counter()
                    outcome = method(path)
                    if asyncio.iscoroutine(outcome):
                        await outcome
                    dist.barrier()
                    if round_index:
                        times.setdefault(name, []).append(time.perf_counter() - started)
                if round_index == 0:
                    samples.clear()
            # Planning without the cached plan: a fresh engine's first save.
            async with Engine(coordination_timeout_s=600) as cold:
                result = await cold.save(state, fresh("cold"))
                samples["plan_uncached_s"] = [result.plan_s]
            fresh("cold")

    uvloop.run(run())
    return {"rank": rank, "nbytes": nbytes, "num_tensors": len(state), "times": times,
            "samples": samples}


def report(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    nbytes = sum(r["nbytes"] for r in ranks)
    names = list(ranks[0]["times"])
    # a round lasts as long as its slowest rank
    rounds = {name: [max(values) for values in zip(*(r["times"][name] for r in ranks),
                                                   strict=True)] for name in names}
    medians = {name: _median(values) for name, values in rounds.items()}
    ours = medians[OURS]
    print(f"\n== {len(ranks)} ranks, {nbytes / GiB:.2f} GiB in all "
          f"({ranks[0]['num_tensors']} tensors per rank), on {args.target} ==")
    print(f"{'method':<34}{'median s':>10}{'GB/s':>8}{'asynctron x':>13}")
    for name, median in sorted(medians.items(), key=lambda kv: kv[1]):
        print(f"{name:<34}{median:>10.3f}{nbytes / median / 1e9:>8.2f}{median / ours:>12.2f}x")
    per_rank = {key: [_median(r["samples"].get(key, [])) for r in ranks]
                for key in ("staged_s", "dcp_async_blocking_s", "plan_s", "plan_uncached_s")}
    delays = [max(r["samples"].get("loop_worst_delay_s", [float("nan")])) for r in ranks]
    print(f"save vs {RAW}: {medians[RAW] / ours:.2f}x")
    for peer in PEERS:
        print(f"save vs {peer}: {medians[peer] / ours:.2f}x (target: ahead, > 1)")
    print("blocking per rank: asynctron (await staged) "
          + ", ".join(f"{v:.3f}" for v in per_rank["staged_s"]) + " s; dcp.async_save "
          + ", ".join(f"{v:.3f}" for v in per_rank["dcp_async_blocking_s"]) + " s")
    print("planning per rank: uncached " + ", ".join(
        f"{v * 1e3:.1f}" for v in per_rank["plan_uncached_s"]) + " ms; cached " + ", ".join(
        f"{v * 1e3:.1f}" for v in per_rank["plan_s"]) + " ms")
    print("loop worst heartbeat delay per rank: "
          + ", ".join(f"{d * 1e3:.1f}" for d in delays) + " ms")
    return {"world_size": len(ranks), "nbytes": nbytes, "target": args.target,
            "saves": {name: {"median_s": medians[name], "gb_per_s": nbytes / medians[name] / 1e9,
                             "asynctron_speedup": medians[name] / ours, "rounds_s": rounds[name]}
                      for name in names},
            "per_rank": per_rank, "loop_worst_delay_s": delays}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench save --nproc N",
                                     description=_results.description(__doc__))
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn")
    parser.add_argument("--size-gib", type=float, default=2.0, help="state size, all ranks")
    parser.add_argument("--target", default=os.getcwd(), help="directory to save into")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.repeats = 0.02, 1
    started = time.time()
    base = _results.scratch_dir(f"asynctron-bench-ranks-{os.getpid()}-", args.target)
    try:
        outcomes = run_local_ranks(_rank, args.nproc, args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if failed := [r for r in outcomes if r.failed]:
        print(f"asynctron bench save --nproc {args.nproc}: rank {failed[0].rank} failed:\n"
              f"{failed[0].error}", flush=True)
        return 1
    ranks = [r.value for r in outcomes]
    summary = report(ranks, args)
    summary["meta"] = _results.run_meta(started, args, torch=torch.__version__,
                                        peers=_peers.peer_versions())
    _results.write_results(f"save_ranks{args.nproc}", summary, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
