"""All-reduce overlap benchmark: asynctron's BucketManager against PyTorch DDP, on 2 ranks.

Each rank trains the same MLPs (about 10M and 100M parameters) on the same data. For each
bucket size (1, 4, 25, 100 MiB, with a 1 MiB first bucket on both sides: DDP gets
`bucket_cap_mb_list=[1, size]`, which for 25 is DDP's default layout), one step is

- asynctron: forward, backward (bucket all-reduces launch during it), `await synchronize()`;
- DDP: forward, backward (DDP waits for its all-reduces at the end of backward);

timed with `time.perf_counter` from forward to synchronized gradients, the two alternating
round by round after an untimed warm-up, each step started on both ranks together (a barrier
on a separate gloo group). A step's time is the slower rank's; medians over the rounds are
reported, with the ratio asynctron / DDP (target <= 1.05). Also measured: compute only
(forward + backward of the same model with nothing communicated, in the same rounds), one
all-reduce of every gradient at once (the communication with nothing to hide it), the exposed
communication (from the last gradient hook until the gradients are synchronized; DDP: until
backward returns) and the loop's worst heartbeat delay during `synchronize()` (an extra
untimed round). With `--trainer`, each rank also runs a busy thread through every measurement
(`asynctron/bench/_trainers.py`): spinning Python (`python`: it holds the GIL, the worst case of
a GPU trainer's dispatch thread), Python with a tiny torch op every few µs (`dispatch`: it gives
the GIL up at each op, as a dispatch thread launching kernels does) or 1-thread torch matmuls
(`torch`).

Run: `asynctron bench comm`; `--quick` for a smoke run;
`--device cuda --backend nccl` on a machine with one GPU per rank.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import uvloop
from torch.nn.parallel import DistributedDataParallel

from asynctron._launch import run_local_ranks
from asynctron.bench import _results
from asynctron.bench._rounds import round_order
from asynctron.bench._trainers import TrainerThread
from asynctron.comm import BucketManager
from asynctron.testing import LoopWatchdog

MiB = 1 << 20
MODELS = {"10M": (1024, 10), "100M": (2896, 12)}  # name -> (width, layers) of an MLP
QUICK_MODELS = {"0.3M": (256, 5), "1M": (512, 4)}


def make_mlp(width: int, num_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(num_layers):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


class _Clock:
    """Step timing that waits for the device first (CUDA work is asynchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _ddp(module: torch.nn.Module, bucket_mb: int, device: torch.device) -> tuple[
        DistributedDataParallel, str]:
    ids = [device.index] if device.type == "cuda" else None
    if bucket_mb > 1:
        try:
            return (DistributedDataParallel(module, device_ids=ids,
                                            bucket_cap_mb_list=[1, bucket_mb]),
                    f"bucket_cap_mb_list=[1, {bucket_mb}]")
        except TypeError:  # a torch without per-bucket caps: no small first bucket
            pass
    return (DistributedDataParallel(module, device_ids=ids, bucket_cap_mb=bucket_mb),
            f"bucket_cap_mb={bucket_mb}")


class _Step:
    """One model on one rank: the data, the clock, and the barrier that starts each step."""

    def __init__(self, width: int, batch_size: int, device: torch.device,
                 aux: dist.ProcessGroup) -> None:
        generator = torch.Generator().manual_seed(dist.get_rank())
        self.x = torch.randn(batch_size, width, generator=generator).to(device)
        self.clock = _Clock(device)
        self.aux = aux

    def loss(self, model: torch.nn.Module) -> torch.Tensor:
        return model(self.x).square().mean()

    def start(self) -> float:
        dist.barrier(group=self.aux)
        return self.clock.now()


def _all_reduce_all(num_params: int, step: _Step, args: argparse.Namespace,
                    device: torch.device) -> list[float]:
    """One all-reduce of every gradient at once: the communication with nothing to hide it."""
    flat = torch.zeros(num_params, device=device)
    samples = []
    for round_index in range(args.warmup + args.repeats):
        start = step.start()
        dist.all_reduce(flat)
        if round_index >= args.warmup:
            samples.append(step.clock.now() - start)
    return samples


def _step_compute(model: torch.nn.Module, step: _Step,
                  timings: dict[str, list[float]] | None) -> None:
    """Forward and backward on the plain module: nothing is communicated."""
    start = step.start()
    step.loss(model).backward()
    elapsed = step.clock.now() - start
    model.zero_grad()
    if timings is not None:
        timings["compute"].append(elapsed)


async def _step_ours(manager: BucketManager, model: torch.nn.Module, step: _Step,
                     timings: dict[str, list[float]] | None) -> None:
    start = step.start()
    step.loss(model).backward()
    await manager.synchronize()
    elapsed = step.clock.now() - start
    assert manager.last_step is not None
    if timings is not None:
        timings["asynctron"].append(elapsed)
        timings["asynctron_exposed"].append(manager.last_step.exposed_s)
        timings["asynctron_reduce"].append(manager.last_step.reduce_s)
    manager.zero_grad()


async def _loop_worst_delay(manager: BucketManager, model: torch.nn.Module,
                            step: _Step) -> float:
    """An untimed step with the heartbeat running during `synchronize()`."""
    step.start()
    step.loss(model).backward()
    async with LoopWatchdog() as dog:
        await manager.synchronize()
    manager.zero_grad()
    return dog.report().worst_delay_s


def _step_ddp(ddp: DistributedDataParallel, hook_times: list[float], step: _Step,
              timings: dict[str, list[float]] | None) -> None:
    hook_times.clear()
    start = step.start()
    step.loss(ddp).backward()
    elapsed = step.clock.now() - start
    if timings is not None:
        timings["ddp"].append(elapsed)
        timings["ddp_exposed"].append(max(0.0, start + elapsed - max(hook_times)))
    ddp.zero_grad()


async def _compare(ours: torch.nn.Module, theirs: torch.nn.Module, bucket_mb: int, step: _Step,
                   args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """asynctron and DDP with the same bucket size, alternating round by round."""
    manager = BucketManager(ours, bucket_size_bytes=bucket_mb * MiB,
                            first_bucket_size_bytes=min(1, bucket_mb) * MiB)
    ddp, ddp_config = _ddp(theirs, bucket_mb, device)
    hook_times: list[float] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda _: hook_times.append(time.perf_counter()))
             for p in theirs.parameters()]
    timings: dict[str, list[float]] = {"asynctron": [], "ddp": [], "compute": [],
                                       "asynctron_exposed": [], "ddp_exposed": [],
                                       "asynctron_reduce": []}
    try:
        for round_index in range(args.warmup + args.repeats):
            record = timings if round_index >= args.warmup else None
            for method in round_order(["asynctron", "ddp", "compute"], round_index):
                if method == "asynctron":
                    await _step_ours(manager, ours, step, record)
                elif method == "ddp":
                    _step_ddp(ddp, hook_times, step, record)
                else:  # DDP ignores a backward whose forward did not go through it
                    _step_compute(theirs, step, record)
        worst_delay_s = await _loop_worst_delay(manager, ours, step)
        logged = ddp._get_ddp_logging_data()  # after a rebuild, its buckets are the rebuilt ones
        ddp_buckets = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", ""))
        return {"num_buckets": len(manager.buckets), "ddp_config": ddp_config,
                "num_ddp_buckets": len(ddp_buckets.split(",")) if ddp_buckets else None,
                "loop_worst_delay": [worst_delay_s], **timings}
    finally:
        for hook in hooks:
            hook.remove()
        manager.close()


async def _measure_model(name: str, width: int, num_layers: int, args: argparse.Namespace,
                         device: torch.device, aux: dist.ProcessGroup) -> dict[str, Any]:
    ours = make_mlp(width, num_layers).to(device)
    theirs = make_mlp(width, num_layers).to(device)
    num_params = sum(p.numel() for p in ours.parameters())
    step = _Step(width, args.batch_size, device, aux)
    result: dict[str, Any] = {"model": name, "num_params": num_params, "width": width,
                              "num_layers": num_layers, "buckets": {}}
    for bucket_mb in args.bucket_mb:
        result["buckets"][bucket_mb] = await _compare(ours, theirs, bucket_mb, step, args,
                                                      device)
    result["all_reduce_all_s"] = _all_reduce_all(num_params, step, args, device)
    return result


async def _rank_work(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    aux = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    models = QUICK_MODELS if args.quick else MODELS
    results = []
    trainer = TrainerThread(args.trainer) if args.trainer != "idle" else None
    if trainer is not None:
        trainer.start()
    try:
        for name in args.models or list(models):
            width, num_layers = models[name]
            results.append(await _measure_model(name, width, num_layers, args, device, aux))
    finally:
        if trainer is not None:
            trainer.stop()
    # a step takes as long as its slowest rank: keep the max over ranks, sample by sample
    everyone: list[list[dict[str, Any]]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, results, group=aux)
    for model_index, result in enumerate(results):
        result["all_reduce_all_s"] = [max(values) for values in zip(
            *(rank[model_index]["all_reduce_all_s"] for rank in everyone), strict=True)]
        for bucket_mb, row in result["buckets"].items():
            for key, values in list(row.items()):
                if isinstance(values, list) and values and isinstance(values[0], float):
                    row[key] = [max(samples) for samples in zip(
                        *(rank[model_index]["buckets"][bucket_mb][key] for rank in everyone),
                        strict=True)]
    return results


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    torch.set_num_threads(args.threads)
    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = uvloop.run(_rank_work(args, device))
    return results if rank == 0 else None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the table; return the JSON-able summary (medians and ratios beside the samples)."""
    print(f"\n{'model':<6}{'params':>8}{'bucket':>8}{'buckets':>9}{'asynctron s':>13}"
          f"{'DDP s':>9}{'ratio':>8}{'compute s':>11}{'exposed ms (ours/DDP)':>24}"
          f"{'loop ms':>9}")
    for result in results:
        result["all_reduce_all_median_s"] = _median(result["all_reduce_all_s"])
        for bucket_mb, row in result["buckets"].items():
            ours, theirs = _median(row["asynctron"]), _median(row["ddp"])
            compute = _median(row["compute"])
            row.update({
                "asynctron_median_s": ours, "ddp_median_s": theirs, "ratio": ours / theirs,
                "compute_median_s": compute, "asynctron_over_compute": ours / compute,
                "asynctron_exposed_median_s": _median(row["asynctron_exposed"]),
                "ddp_exposed_median_s": _median(row["ddp_exposed"]),
                "loop_worst_delay_s": max(row.get("loop_worst_delay", [float("nan")]))})
            print(f"{result['model']:<6}{result['num_params'] / 1e6:>7.1f}M{bucket_mb:>6} MB"
                  f"{row['num_buckets']:>5}/{row['num_ddp_buckets'] or '?':<3}{ours:>13.3f}"
                  f"{theirs:>9.3f}{ours / theirs:>7.3f}x{compute:>11.3f}"
                  f"{row['asynctron_exposed_median_s'] * 1e3:>13.1f} / "
                  f"{row['ddp_exposed_median_s'] * 1e3:<9.1f}"
                  f"{row['loop_worst_delay_s'] * 1e3:>9.2f}")
        print(f"{result['model']}: one all-reduce of all {result['num_params'] * 4 / MiB:.0f} MiB "
              f"of gradients takes {result['all_reduce_all_median_s']:.3f} s")
    return {"models": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench comm",
                                     description=_results.description(__doc__))
    parser.add_argument("--models", nargs="*", help=f"subset of {list(MODELS)}")
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[1, 4, 25, 100])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: gloo on cpu, nccl on cuda")
    parser.add_argument("--trainer", choices=["idle", "python", "dispatch", "torch"],
                        default="idle",
                        help="a busy thread in each rank: spinning Python (holds the GIL), "
                             "Python with a tiny torch op every few µs (gives it up at each) "
                             "or 1-thread torch matmuls")
    parser.add_argument("--quick", action="store_true", help="tiny models, one repeat (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.bucket_mb, args.repeats, args.warmup = [1, 4], 1, 1
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        print(f"asynctron bench comm: --device cuda: expected {args.world_size} GPUs (one per "
              f"rank), found {torch.cuda.device_count()}; pass --world-size "
              f"{max(1, torch.cuda.device_count())} or run on CPU", flush=True)
        return 2
    started = time.time()
    ranks = run_local_ranks(_rank, args.world_size, args, backend=args.backend)
    if failed := [r for r in ranks if r.failed]:
        print(f"asynctron bench comm: rank {failed[0].rank} failed:\n{failed[0].error}",
              flush=True)
        return 1
    results = ranks[0].value
    summary = report(results)
    summary["meta"] = _results.run_meta(
        started, args, torch=torch.__version__,
        device=args.device if args.device == "cpu" else torch.cuda.get_device_name(0))
    _results.write_results("allreduce_overlap", summary, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
