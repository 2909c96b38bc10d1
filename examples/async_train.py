"""An async data-parallel training loop: backward's all-reduces overlap the next batch's read.

Each rank trains the same MLP on its share of a memory-mapped .npy file (features and a target
per row). Per step:

    batch k+1 is read on the engine's executor      (started before step k's forward)
    forward, backward of batch k                    (bucket all-reduces launch during backward)
    await model.step(optimizer)                     (synchronize, optimizer.step(), zero_grad())

so the read and the all-reduces both run while backward computes. At the end every rank checks
that its parameters are bit-identical to rank 0's.

Run: `python examples/async_train.py --world-size 2` (spawns the ranks on this host, gloo), or
under `torchrun --nproc-per-node 2 examples/async_train.py` (joins torchrun's group). Without
`--data`, a synthetic regression set is written to a temporary file first.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import uvloop

from asynctron import Engine
from asynctron.comm import AsyncDataParallel, CollectiveGroup, new_gloo_group


def write_synthetic(path: str, *, num_samples: int, num_features: int, seed: int = 0) -> None:
    """A float32 .npy of rows `[x..., y]` with `y = x @ w + noise` (memory-mapped on write)."""
    rng = np.random.default_rng(seed)
    rows = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                     shape=(num_samples, num_features + 1))
    weights = rng.standard_normal(num_features).astype(np.float32)
    for start in range(0, num_samples, 65536):
        x = rng.standard_normal((min(65536, num_samples - start), num_features),
                                dtype=np.float32)
        rows[start:start + len(x), :-1] = x
        rows[start:start + len(x), -1] = x @ weights + 0.1 * rng.standard_normal(len(x))
    rows.flush()
    del rows


class MemmapBatches:
    """This rank's batches of a memory-mapped .npy file of rows `[x..., y]`.

    Each epoch shuffles the rows (the same permutation on every rank) and gives rank r every
    world_size-th batch. The gather of a batch's rows out of the map (page faults, disk reads)
    runs through `run_blocking`, off the loop.
    """

    def __init__(self, path: str, *, batch_size: int, rank: int, world_size: int,
                 run_blocking: Callable[..., Awaitable[Any]]) -> None:
        self._rows = np.load(path, mmap_mode="r")
        if self._rows.ndim != 2 or self._rows.shape[1] < 2:
            raise ValueError(f"data file {path}: expected rows of [features..., target], found "
                             f"shape {self._rows.shape}; write it with write_synthetic()")
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self._run_blocking = run_blocking

    def _gather(self, indices: np.ndarray) -> np.ndarray:
        return self._rows[np.sort(indices)]  # a copy: the rows leave the map here

    async def batches(self) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches forever, epoch after epoch."""
        num_rows = len(self._rows)
        for epoch in range(sys.maxsize):
            order = np.random.default_rng(epoch).permutation(num_rows)
            stride = self.batch_size * self.world_size
            for start in range(self.rank * self.batch_size, num_rows - stride + 1, stride):
                rows = await self._run_blocking(self._gather,
                                                order[start:start + self.batch_size])
                batch = torch.from_numpy(rows)
                yield batch[:, :-1], batch[:, -1:]


def make_model(num_features: int, hidden: int, num_layers: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(num_features, hidden), torch.nn.GELU()]
    for _ in range(num_layers - 2):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 1))


async def train(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    """Train on this rank; returns what it measured (the same on every rank but the times)."""
    coordination = new_gloo_group(timeout_s=60)
    torch.manual_seed(rank)  # different on purpose: broadcast_parameters() aligns them
    num_features = np.load(args.data, mmap_mode="r").shape[1] - 1
    async with Engine(num_workers=2) as engine:
        model = AsyncDataParallel(make_model(num_features, args.hidden, args.layers),
                             bucket_size_bytes=int(args.bucket_mb * 2**20),
                             run_blocking=engine.run_blocking)
        await model.broadcast_parameters()
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        source = MemmapBatches(args.data, batch_size=args.batch_size, rank=rank,
                               world_size=world_size, run_blocking=engine.run_blocking)
        batches = source.batches()
        losses, fetch_wait_s, step_s, exposed_s = [], [], [], []
        async with asyncio.TaskGroup() as tasks:
            pending = tasks.create_task(anext(batches))
            for step in range(args.steps):
                started = time.perf_counter()
                x, y = await pending
                fetch_wait_s.append(time.perf_counter() - started)
                if step + 1 < args.steps:  # batch k+1 is read while step k computes
                    pending = tasks.create_task(anext(batches))
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                await model.step(optimizer)
                losses.append(loss.item())
                step_s.append(time.perf_counter() - started)
                assert model.last_step is not None
                exposed_s.append(model.last_step.exposed_s)
        await batches.aclose()
        group = CollectiveGroup(coordination, run_blocking=engine.run_blocking, timeout_s=60)
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()
        everyone = await group.all_gather_object(
            (digest, statistics.fmean(losses[:5]), statistics.fmean(losses[-5:])))
    return {"rank": rank, "world_size": world_size, "num_steps": args.steps,
            "num_buckets": len(model.manager.buckets),
            "first_loss": statistics.fmean(first for _, first, _ in everyone),
            "last_loss": statistics.fmean(last for _, _, last in everyone),
            "identical_parameters": len({digest for digest, _, _ in everyone}) == 1,
            "median_step_s": statistics.median(step_s),
            "median_fetch_wait_s": statistics.median(fetch_wait_s[1:] or fetch_wait_s),
            "median_exposed_comm_s": statistics.median(exposed_s)}


def run_rank(rank: int, world_size: int, port: int | None, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if port is None:  # under torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=120))
    try:
        result = uvloop.run(train(args, rank, world_size))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(f"{world_size} ranks, {result['num_steps']} steps, {result['num_buckets']} buckets: "
              f"loss {result['first_loss']:.4f} -> {result['last_loss']:.4f}; median step "
              f"{result['median_step_s'] * 1e3:.1f} ms, waiting for data "
              f"{result['median_fetch_wait_s'] * 1e3:.2f} ms, exposed all-reduce "
              f"{result['median_exposed_comm_s'] * 1e3:.2f} ms; parameters identical on every "
              f"rank: {result['identical_parameters']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if not result["identical_parameters"]:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (no torchrun)")
    parser.add_argument("--data", help="a .npy of float32 rows [features..., target]")
    parser.add_argument("--samples", type=int, default=65536, help="synthetic rows")
    parser.add_argument("--features", type=int, default=64, help="synthetic features")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="gradient bucket cap in MiB, as DDP's bucket_cap_mb")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", help="write rank 0's results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="asynctron-example-") as scratch:
        if args.data is None:
            args.data = os.path.join(scratch, "rows.npy")
            write_synthetic(args.data, num_samples=args.samples, num_features=args.features)
        if "WORLD_SIZE" in os.environ:  # torchrun started us
            run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
            return 0
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        ranks = [context.Process(target=run_rank, args=(rank, args.world_size, port, args))
                 for rank in range(args.world_size)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        return max(abs(process.exitcode or 0) for process in ranks)


if __name__ == "__main__":
    raise SystemExit(main())
