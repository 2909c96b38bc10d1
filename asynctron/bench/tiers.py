"""Tiered checkpoints on the state a large job holds (FSDP2's DTensors, AdamW's state): the tiers
against a plain multi-rank save, the physical floors under them, asynctron's own direct save to
the store, a multi-rank `load_into`, and stock `dcp.load` from the same store behind a model of
a remote store, on the same spawned ranks ("nodes" of `--ranks-per-node` on this machine), in
one run. A real SeaweedFS started by the run is the store; each node reaches it through its
own `asynctron.testing.ShapingProxy` (`--store-profile`, default `s3-node`: one node's
bandwidth to S3 and S3's first-byte latency, from AWS's figures).

Per round (medians over `--repeats`, after an untimed warm-up; each figure the slowest rank's,
between barriers): saves, blocking and committed, against the plain save and against the
floor (the longer of the raw send to the replica holders and the raw write of what each
node's tier holds); restores from the local tier (cold) against the raw read, from the next
node against the raw send; a drain against the direct save to the store; restores from the
store (loopback and through the proxy) against stock `dcp.load` through the proxy; the job
restarted on one node (elastic) restoring from the store against a multi-rank `load_into`;
the bytes each tier holds per checkpoint (FSDP2, data-parallel and HSDP states); then two
trainers saving every step against no saves (`_tiers_trainers`). Details: `_tiers_ranks`.

Run: `asynctron bench tiers` (4 ranks as 2 nodes, 1 GiB in all; `--target /dev/shm` for local
tiers in memory); `--quick` for a smoke run. Results: printed, and JSON (`--out`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from asynctron.bench import _results
from asynctron.bench._tiers_ranks import RunConfig, elastic, measure

GiB = 1 << 30
MiB = 1 << 20
TARGETS = {
    "save blocking, tiers / plain multi-rank save": ("<=", 1.1),
    "time to committed, tiers / physical floor": ("<=", 1.25),
    "restore from the local tier, raw read / restore": (">=", 0.9),
    "restore from a replica, raw send / restore": (">=", 0.7),
    "elastic restore from the store, load_into / restore": (">=", 0.9),
    "restore from the local tier vs stock dcp.load (proxied store)": (">=", 10.0),
    "restore from a replica vs stock dcp.load (proxied store)": (">=", 10.0),
    "store bytes per checkpoint of a data-parallel state / its size": ("<=", 1.05),
    "store bytes read per restore of a data-parallel state / its size": ("<=", 1.05),
    "FSDP2 restore from the store (proxied), own reads / shared reads": (">=", 1.0),
    "accelerated trainer, saving every step / no saves": ("<=", 1.05),
}
"""Issue 46's targets, as ratios computed in `report`."""


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _rounds(ranks: list[dict[str, Any]], field: str = "times") -> dict[str, list[float]]:
    """Each measure's rounds: per round, the slowest rank's figure."""
    names = list(ranks[0][field])
    return {name: [max(values) for values in zip(*(r[field][name] for r in ranks),
                                                 strict=True)] for name in names}


def report(job: list[dict[str, Any]], smaller: list[dict[str, Any]],
           trainers: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The figures (each round's slowest rank; medians of rounds) and the targets' ratios."""
    world = len(job)
    rounds = {**_rounds(job), **_rounds(smaller), **_rounds(trainers)}
    median = {name: _median(values) for name, values in rounds.items()}
    cpu = {name: _median(values) for name, values in _rounds(job, "cpu").items()}
    nbytes = job[0]["nbytes"]
    print(f"\n== tiers: {world} ranks as {world // args.ranks_per_node} nodes of "
          f"{args.ranks_per_node}, FSDP2 state of {job[0]['state_nbytes'] / GiB:.2f} GiB "
          f"({nbytes / MiB:.0f} MiB per rank), local tiers on {args.target}; store behind "
          f"{args.store_profile} ==")
    print(f"{'measure':<56}{'median s':>10}{'GB/s per rank':>15}{'CPU s/GB':>10}")
    for name, value in median.items():
        rate = "" if "trainer" in name else f"{nbytes / value / 1e9:>15.2f}"
        if "trainer" in name:
            per_save = 'blocked' in name or 'planned' in name
            rate = f"{'(per save)' if per_save else '(per step)':>15}"
        cost = f"{cpu[name] / (nbytes / 1e9):>10.2f}" if name in cpu else ""
        print(f"{name:<56}{value:>10.3f}{rate}{cost}")
    floor = max(median["raw send"], median["raw write"])
    stock = [value for name, value in median.items() if name.startswith("dcp.load")]
    best_stock = min(stock) if stock else float("nan")
    held = job[0]["notes"]["tier bytes"]
    ratios = {
        "save blocking, tiers / plain multi-rank save":
            median["tiers blocking"] / median["plain blocking"],
        "save committed, tiers / plain multi-rank save":
            median["tiers committed"] / median["plain committed"],
        "time to committed, tiers / physical floor": median["tiers committed"] / floor,
        "restore from the local tier, raw read / restore":
            median["raw read"] / median["restore local"],
        "restore from a replica, raw send / restore":
            median["raw send"] / median["restore replica"],
        "elastic restore from the store, load_into / restore":
            median["load_into of the same checkpoint"] / median[
                "elastic restore from the store"],
        "restore from the local tier vs stock dcp.load (proxied store)":
            best_stock / median["restore local"],
        "restore from a replica vs stock dcp.load (proxied store)":
            best_stock / median["restore replica"],
        "restore from the store (proxied) vs stock dcp.load (proxied store)":
            best_stock / median["restore store, proxied"],
        "drain, direct save to the store / drain":
            median["direct save to the store"] / median["drain"],
        "store bytes per checkpoint of a data-parallel state / its size":
            held["ddp"]["store"] / held["ddp"]["state"],
        "store bytes read per restore of a data-parallel state / its size":
            held["ddp"]["store read, shared"] / held["ddp"]["state"],
        "data-parallel restore from the store (proxied), own reads / shared reads":
            median["ddp restore from the store, proxied, each rank its own"] / median[
                "ddp restore from the store, proxied, shared reads"],
        "FSDP2 restore from the store (proxied), own reads / shared reads":
            median["fsdp restore from the store, proxied, each rank its own"] / median[
                "fsdp restore from the store, proxied, shared reads"],
    }
    for trainer in ("accelerated trainer", "cpu trainer"):
        if f"{trainer}, no saves" in median:
            ratios[f"{trainer}, saving every step / no saves"] = (
                median[f"{trainer}, saving every step"] / median[f"{trainer}, no saves"])
    if "nvidia-resiliency-ext save (blocking)" in median:
        ratios.update({
            "save blocking vs nvidia-resiliency-ext (synchronous)":
                median["nvidia-resiliency-ext save (blocking)"] / median["tiers blocking"],
            "restore from the local tier vs nvidia-resiliency-ext":
                median["nvidia-resiliency-ext restore local"] / median["restore local"]})
    print()
    for name, ratio in ratios.items():
        target = TARGETS.get(name)
        verdict = ""
        if target is not None:
            sign, bound = target
            met = ratio <= bound if sign == "<=" else ratio >= bound
            verdict = f"  (target {sign} {bound:g}: {'met' if met else 'NOT met'})"
        print(f"{name:<68}{ratio:>8.2f}x{verdict}")
    print("\nbytes each tier holds per checkpoint (x the state's size):")
    for layout, found in held.items():
        state = found["state"]
        print(f"  {layout:<5} state {state / MiB:8.1f} MiB: local tiers "
              f"{', '.join(f'{b / state:.2f}' for b in found['local'])} (replicas in them: "
              f"{', '.join(f'{b / state:.2f}' for b in found['replicas'])}); store "
              f"{found['store'] / state:.2f}; restored from the store, the job read "
              f"{found['store read, shared'] / state:.2f} (shared reads) and "
              f"{found['store read, own'] / state:.2f} (each rank its own)")
    notes = {**job[0]["notes"], **smaller[0]["notes"], **trainers[0]["notes"]}
    for note in ("replica sources", "elastic sources", "accelerated trainer",
                 "nvidia-resiliency-ext"):
        print(f"{note}: {notes.get(note)}")
    return {"world_size": world, "ranks_per_node": args.ranks_per_node,
            "nbytes_per_rank": nbytes, "state_nbytes": job[0]["state_nbytes"],
            "target": args.target, "store_profile": args.store_profile, "median_s": median,
            "cpu_s": cpu, "rounds_s": rounds, "ratios": ratios, "notes": notes,
            "replica_sources": notes.get("replica sources")}


def main(argv: list[str] | None = None) -> int:
    from asynctron._launch import run_local_ranks
    from asynctron.bench import _tiers_trainers
    from asynctron.testing import ShapingProxy, StoreProfile
    from asynctron.testing.seaweedfs import SeaweedFS

    parser = argparse.ArgumentParser(
        prog="asynctron bench tiers", description=_results.description(__doc__))
    parser.add_argument("--nproc", type=int, default=4, help="ranks to spawn")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node")
    parser.add_argument("--size-gib", type=float, default=1.0,
                        help="the FSDP2 state's size, all ranks")
    parser.add_argument("--target", default=os.getcwd(),
                        help="where the local tiers (and the plain save) go")
    parser.add_argument("--store-profile", default="s3-node",
                        help="the remote store the proxies model (asynctron.testing."
                             "StoreProfile: a preset or key=value overrides)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer-steps", type=int, default=20,
                        help="steps of each trainer run (0: skip the trainers)")
    parser.add_argument("--trainer-state-mib", type=float, default=64.0,
                        help="the accelerated trainer's state per rank")
    parser.add_argument("--trainer-step-s", type=float, default=0.5,
                        help="the accelerated trainer's step (its compute a sleep)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.nproc, args.ranks_per_node, args.size_gib, args.repeats = 2, 1, 0.02, 1
        args.trainer_steps, args.trainer_state_mib = min(args.trainer_steps, 3), 2.0
        args.trainer_step_s = 0.05
    if args.nproc % args.ranks_per_node or args.nproc // args.ranks_per_node < 2:
        parser.error("--nproc must be whole nodes of --ranks-per-node, at least two")
    profile = StoreProfile.parse(args.store_profile)
    started = time.time()
    base = _results.scratch_dir(f"asynctron-bench-tiers-{os.getpid()}-", args.target)
    nodes = args.nproc // args.ranks_per_node
    with tempfile.TemporaryDirectory(prefix="asynctron-bench-store-") as data, \
            SeaweedFS.start(data) as server:
        os.environ.update(server.environment())
        host, _, port = server.endpoint.removeprefix("http://").partition(":")
        proxies = [ShapingProxy.start(host, int(port), profile) for _ in range(nodes)]
        config = RunConfig(ranks_per_node=args.ranks_per_node, size_gib=args.size_gib,
                           repeats=args.repeats, base=base,
                           store=f"s3://{server.bucket}/tiers", endpoint=server.endpoint,
                           proxied=tuple(proxy.endpoint for proxy in proxies))
        try:
            outcomes = run_local_ranks(measure, args.nproc, config, timeout_s=3600)
            if not any(r.failed for r in outcomes):
                outcomes += run_local_ranks(elastic, args.ranks_per_node, config,
                                            timeout_s=3600)
            if args.trainer_steps and not any(r.failed for r in outcomes):
                outcomes += run_local_ranks(_tiers_trainers.run, args.nproc, config,
                                            args.trainer_steps, args.trainer_state_mib,
                                            args.trainer_step_s, timeout_s=3600)
        finally:
            for proxy in proxies:
                proxy.stop()
            shutil.rmtree(base, ignore_errors=True)
    if failed := [r for r in outcomes if r.failed]:
        print(f"asynctron bench tiers: rank {failed[0].rank} failed (exit code "
              f"{failed[0].exitcode}):\n{failed[0].error}", flush=True)
        return 1
    values = [r.value for r in outcomes]
    job, smaller = values[:args.nproc], values[args.nproc:args.nproc + args.ranks_per_node]
    trainers = values[args.nproc + args.ranks_per_node:]
    summary = report(job, smaller, trainers or [{"times": {}, "notes": {}}], args)
    summary["meta"] = _results.run_meta(started, args, torch=torch.__version__)
    _results.write_results("tiers", summary, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
