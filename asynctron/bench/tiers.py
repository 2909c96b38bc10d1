"""Tiered checkpoints: asynctron's tiers against a plain local save, the raw transfers under
them, asynctron's own direct save to the store, and stock `dcp.load` from the same store, on
the same spawned ranks ("nodes" of `--ranks-per-node` on this machine), the same state, in one
run. A real SeaweedFS started by the run is the store.

Per round (medians over `--repeats`, after an untimed warm-up round; each figure the slowest
rank's, between barriers):
- save: blocking (`await task.staged`) and time to committed, tiers (the node's local tier and
  a replica on the next node) against a plain multi-rank save of the same state to a local
  directory on the same storage;
- replication: each rank's bytes against a raw torch.distributed (gloo) send of the same bytes
  to the same peer while receiving its source's, 64 MiB messages;
- restore (into the trainer's tensors, every digest verified): from the local tier (against
  reading the same files raw), from a replica with the next node's tier deleted (against the
  raw send), from the store with every local tier deleted; stock `dcp.load` of the same state
  from the same store, through DCP's FsspecReader (s3fs) and s3torchconnector's reader;
- NVIDIA's resiliency extension's local checkpointing (where installed) on the same nodes and
  replicas: its save (synchronous on a CPU machine: its asynchronous one needs CUDA) and its
  restore from the local directory (its restore from replicas needs CUDA);
- drain: a step to the store from the local tier's files, against asynctron's direct save of
  the same state to the store.
Then a trainer saving every step through the tiers (the demo's GPT, data-parallel on these
ranks) against the same trainer without saves: step time.

Run: `asynctron bench tiers` (4 ranks as 2 nodes, 1 GiB in all; `--target /dev/shm` for local
tiers in memory); `--quick` for a smoke run. Results: printed, and JSON (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import torch.distributed as dist

from asynctron import Engine, Tiers
from asynctron._knobs import RANKS_PER_NODE
from asynctron.bench import _baselines, _results

GiB = 1 << 30
MiB = 1 << 20
MESSAGE_BYTES = 64 * MiB
TARGETS = {
    "save blocking, tiers / plain local save": ("<=", 1.1),
    "replication, raw send / tiers": (">=", 0.8),
    "restore from the local tier, raw read / restore": (">=", 0.9),
    "restore from a replica, raw send / restore": (">=", 0.7),
    "restore from the local tier vs stock dcp.load from the store": (">=", 10.0),
    "restore from a replica vs stock dcp.load from the store": (">=", 10.0),
    "drain, direct save to the store / drain": (">=", 0.9),
    "trainer step time, saving every step / no saves": ("<=", 1.05),
}
"""Issue 35's targets, as ratios computed in `report`."""


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class _Clock:
    """Per-measurement times of this rank, each between barriers (so the slowest rank's time
    is the round's)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.notes: dict[str, Any] = {}

    async def time(self, name: str, work: Callable[[], Awaitable[Any]], *,
                   keep: bool = True) -> Any:
        await asyncio.to_thread(dist.barrier)
        started = time.perf_counter()
        value = await work()
        elapsed = time.perf_counter() - started
        await asyncio.to_thread(dist.barrier)
        if keep:
            self.times.setdefault(name, []).append(elapsed)
        return value


def _rank(rank: int, world: int, args: argparse.Namespace, base: str, store: str) -> Any:
    import uvloop

    os.environ[RANKS_PER_NODE] = str(args.ranks_per_node)
    torch.set_num_threads(1)
    nbytes = int(args.size_gib * GiB) // world
    state = {f"rank{rank}.{key}": tensor for key, tensor in
             _baselines.make_state_dict(nbytes, seed=100 + rank).items()}  # every rank's own
    clock = _Clock()
    uvloop.run(_measure(rank, world, args, base, store, state, clock))
    if args.trainer_steps:
        uvloop.run(_trainer(rank, world, args, base, clock))
    return {"rank": rank, "nbytes": sum(t.nbytes for t in state.values()),
            "times": clock.times, "notes": clock.notes}


async def _measure(rank: int, world: int, args: argparse.Namespace, base: str, store: str,
                   state: dict[str, torch.Tensor], clock: _Clock) -> None:
    per_node = args.ranks_per_node
    nodes = world // per_node
    tiers = Tiers(local=f"{base}/tiers/node{{node}}", store=store, replicas=1,
                  store_every=1 << 40, keep_local=2)  # drains measured on their own below
    target = {key: torch.zeros_like(tensor) for key, tensor in state.items()}
    sent = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    received = torch.zeros(sent.numel() + 2 * MESSAGE_BYTES, dtype=torch.uint8)  # + padding
    peers = dist.new_group(backend="gloo")
    holder, source = (rank + per_node) % world, (rank - per_node) % world

    async def raw_send() -> None:
        def transfer() -> None:
            works = []
            for start in range(0, sent.numel(), MESSAGE_BYTES):
                end = min(start + MESSAGE_BYTES, sent.numel())
                works.append(dist.isend(sent[start:end], holder, group=peers))
                works.append(dist.irecv(received[start:end], source, group=peers))
            for work in works:
                work.wait()
        await asyncio.to_thread(transfer)

    async with Engine(coordination_timeout_s=600) as plain, Engine(
            tiers=tiers, coordination_timeout_s=600) as tiered:
        for engine in (plain, tiered):
            await engine.prefault_staging(nbytes_of(state))
        shard_files: list[str] = []
        for round_index in range(args.repeats + 1):  # round 0: untimed, warms every path
            keep = round_index > 0
            if rank == 0:
                shutil.rmtree(f"{base}/plain", ignore_errors=True)
            path = f"{base}/plain/step_{round_index}"

            async def plain_save(path: str = path, keep: bool = keep) -> None:
                started = time.perf_counter()
                task = plain.save(state, path)
                await task.staged
                if keep:
                    clock.times.setdefault("plain blocking", []).append(
                        time.perf_counter() - started)
                await task

            async def tiered_save(step: int = round_index + 1, keep: bool = keep) -> None:
                started = time.perf_counter()
                task = tiered.save(state, step=step)
                await task.staged
                if keep:
                    clock.times.setdefault("tiers blocking", []).append(
                        time.perf_counter() - started)
                result = await task
                shard_files[:] = [os.path.join(result.path, name) for name in result.files]

            await clock.time("plain committed", plain_save, keep=keep)
            await clock.time("tiers committed", tiered_save, keep=keep)
            await clock.time("raw send", raw_send, keep=keep)
            _evict(shard_files)  # both read the files cold, as after a restart
            await clock.time("raw read", lambda: asyncio.to_thread(_read_raw, shard_files,
                                                                    received), keep=keep)
            _evict(shard_files)
            found = await clock.time("restore local", lambda: tiered.restore(target), keep=keep)
            _check(found, "local", state, target)
            if rank == (nodes - 1) * per_node:  # the last node lost: its tier deleted
                shutil.rmtree(tiers.local_root(nodes - 1), ignore_errors=True)
            found = await clock.time("restore replica", lambda: tiered.restore(target),
                                     keep=keep)
            _check(found, "replica", state, target)
            clock.notes["replica sources"] = list(found.sources)
        await _store_phase(rank, args, base, store, state, target, tiers, plain, clock)
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        await asyncio.to_thread(_nvrx, rank, world, args, base, state, clock)
    else:
        clock.notes["nvidia-resiliency-ext"] = "not installed (pip install asynctron[bench])"


async def _store_phase(rank: int, args: argparse.Namespace, base: str, store: str,
                       state: dict[str, torch.Tensor], target: dict[str, torch.Tensor],
                       tiers: Tiers, plain: Engine, clock: _Clock) -> None:
    """Drains and direct saves to the store; restores from it, asynctron's and stock DCP's."""
    per_node = args.ranks_per_node
    draining = Tiers(local=tiers.local, store=store, replicas=1, store_every=1, keep_local=1)
    for round_index in range(args.repeats + 1):
        keep = round_index > 0
        step = 1000 + round_index
        engine = Engine(tiers=draining, coordination_timeout_s=600)
        await engine.start()

        async def drain(engine: Engine = engine, step: int = step, keep: bool = keep) -> None:
            await engine.save(state, step=step)
            started = time.perf_counter()
            await engine.aclose()  # waits for the drain, which began at the commit
            if keep:
                clock.times.setdefault("drain", []).append(time.perf_counter() - started)

        await clock.time("save and drain", drain, keep=keep)
        await clock.time("direct save to the store", lambda i=round_index: plain.save(
            state, f"{store}/direct/step_{i}"), keep=keep)
    if rank % per_node == 0:  # every node lost: only the store is left
        shutil.rmtree(draining.local_root(rank // per_node), ignore_errors=True)
    async with Engine(tiers=draining, coordination_timeout_s=600) as engine:
        for round_index in range(args.repeats + 1):  # a restore from the store writes no tier
            found = await clock.time("restore store", lambda e=engine: e.restore(target),
                                     keep=round_index > 0)
            _check(found, "store", state, target)
    await _stock_dcp(rank, args, store, state, clock)


async def _stock_dcp(rank: int, args: argparse.Namespace, store: str,
                     state: dict[str, torch.Tensor], clock: _Clock) -> None:
    """Stock `dcp.load` of the same state (each rank's keys its own) from the same store,
    through each S3 reader installed."""
    import torch.distributed.checkpoint as dcp

    mine = state  # its keys are the rank's own: stock DCP keeps every rank's
    into = {key: torch.zeros_like(tensor) for key, tensor in mine.items()}
    url = f"{store}/stock-dcp"
    await asyncio.to_thread(dcp.save, mine, storage_writer=_fsspec(url, writing=True))
    readers: dict[str, Callable[[], Any]] = {
        "dcp.load (FsspecReader, s3fs)": lambda: _fsspec(url, writing=False)}
    if importlib.util.find_spec("s3torchconnector") is not None:
        readers["dcp.load (s3torchconnector)"] = lambda: _s3torch(url)
    for name, reader in readers.items():
        for round_index in range(args.repeats + 1):
            await clock.time(name, lambda r=reader: asyncio.to_thread(
                dcp.load, into, storage_reader=r()), keep=round_index > 0)
        assert all(torch.equal(mine[key], into[key]) for key in mine), name


def _fsspec(url: str, *, writing: bool) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"],
               "client_kwargs": {"region_name": os.environ["AWS_REGION"]},
               "config_kwargs": {"s3": {"addressing_style": "path"}}}
    if writing:
        return FsspecWriter(url, sync_files=False, thread_count=4, **options)
    return FsspecReader(url, **options)


def _s3torch(url: str) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(os.environ["AWS_REGION"], url,
                           s3client_config=S3ClientConfig(force_path_style=True))


def _read_raw(paths: list[str], into: torch.Tensor) -> int:
    """Blocks: read the files whole, one after another, into `into` (touched before, as a
    restore's target tensors are), in 64 MiB preads; returns the bytes read."""
    view = memoryview(into.numpy())
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while got := os.preadv(fd, [view[total:total + MESSAGE_BYTES]], offset):
                offset += got
                total += got
        finally:
            os.close(fd)
    return total


def _evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (they are clean: fsynced at commit)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _check(found: Any, source: str, state: dict[str, torch.Tensor],
           target: dict[str, torch.Tensor]) -> None:
    if source not in found.sources:
        raise AssertionError(f"expected a rank restored from {source}, found {found.sources}")
    for key, tensor in state.items():
        if not torch.equal(tensor, target[key]):
            raise AssertionError(f"restore from {source}: {key} differs from what was saved")
        target[key].zero_()


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(tensor.nbytes for tensor in state.values())


def _nvrx(rank: int, world: int, args: argparse.Namespace, base: str,
          state: dict[str, torch.Tensor], clock: _Clock) -> None:
    """Blocks: NVIDIA's resiliency extension's local checkpoints of the same state, on the
    same nodes with the same replicas (synchronous: its asynchronous save needs CUDA): save,
    and restore from the local directory."""
    from asynctron.bench._nvrx import CpuStateDict, manager

    per_node = args.ranks_per_node
    root = f"{base}/nvrx/node{rank // per_node}"
    for round_index in range(args.repeats + 1):
        keep = round_index > 0
        iteration = round_index + 1
        ckpt = manager(root, per_node)
        _timed(clock, "nvidia-resiliency-ext save (blocking)",
               lambda c=ckpt, i=iteration: c.save(CpuStateDict(state), i), keep)

        def restore(iteration: int = iteration) -> None:
            found = manager(root, per_node)
            assert found.find_latest() == iteration
            loaded, _ = found.load()
            assert all(torch.equal(loaded.state()[key], value) for key, value in state.items())

        _timed(clock, "nvidia-resiliency-ext restore local", restore, keep)
    # Its restore of a lost node's shards from their replicas cannot run here: the retrieval
    # moves every tensor to CUDA before sending it (`isend_state_dict`: `ten.cuda()`).
    clock.notes["nvidia-resiliency-ext"] = (
        "save (synchronous) and restore from the local directory measured; its restore from "
        "replicas needs CUDA (group_utils.isend_state_dict moves each tensor to the GPU)")


def _timed(clock: _Clock, name: str, work: Callable[[], Any], keep: bool) -> None:
    """Blocks: `work()` between barriers, its time kept under `name`."""
    dist.barrier()
    started = time.perf_counter()
    work()
    elapsed = time.perf_counter() - started
    dist.barrier()
    if keep:
        clock.times.setdefault(name, []).append(elapsed)


async def _trainer(rank: int, world: int, args: argparse.Namespace, base: str,
                   clock: _Clock) -> None:
    """The demo's GPT, data-parallel on these ranks: step time saving every step through the
    tiers against no saves (each run `--trainer-steps` steps, the two in turns)."""
    from asynctron._demo._corpus import write_corpus
    from asynctron._demo._trainer import DemoConfig, TieredCheckpoints, dataset, train

    out = f"{base}/trainer"
    prefix = os.path.join(out, "corpus", "corpus_text_document")
    if rank == 0:
        prefix = write_corpus(os.path.join(out, "corpus"), num_documents=1000, seed=0)
    prefix = (await asyncio.to_thread(_broadcast, prefix))
    config = DemoConfig(out=out, num_ranks=world, num_steps=args.trainer_steps, save_every=1,
                        num_nodes=0)
    samples = dataset(config, prefix, world)
    tiers = Tiers(local=f"{out}/tiers/node{{node}}", replicas=1, keep_local=2)
    for round_index in range(args.repeats + 1):
        keep = round_index > 0
        for name, checkpoints in (("trainer, no saves", None),
                                  ("trainer, saving every step", TieredCheckpoints(tiers))):
            report = await train(config, rank, samples, name, stop_step=config.num_steps,
                                 checkpoints=checkpoints, resume=False, world_size=world)
            if keep:
                clock.times.setdefault(name, []).append(report.train_s / len(report.losses))
                if checkpoints is not None:
                    clock.times.setdefault("trainer, blocked per save", []).append(
                        report.blocked_s / max(1, report.num_saves))
            if checkpoints is not None and rank % args.ranks_per_node == 0:
                shutil.rmtree(tiers.local_root(rank // args.ranks_per_node), ignore_errors=True)
            await asyncio.to_thread(dist.barrier)


def _broadcast(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def report(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The figures (each round's slowest rank; medians of rounds) and the targets' ratios."""
    world = len(ranks)
    names = list(ranks[0]["times"])
    rounds = {name: [max(values) for values in zip(*(r["times"][name] for r in ranks),
                                                   strict=True)] for name in names}
    median = {name: _median(values) for name, values in rounds.items()}
    nbytes = ranks[0]["nbytes"]
    print(f"\n== tiers: {world} ranks as {world // args.ranks_per_node} nodes of "
          f"{args.ranks_per_node}, {nbytes * world / GiB:.2f} GiB in all "
          f"({nbytes / MiB:.0f} MiB per rank), local tiers on {args.target} ==")
    print(f"{'measure':<48}{'median s':>10}{'GB/s per rank':>15}")
    for name in names:
        rate = "" if name.startswith("trainer") else f"{nbytes / median[name] / 1e9:>15.2f}"
        if name.startswith("trainer"):
            rate = "   (per step)" if "blocked" not in name else "   (per save)"
        print(f"{name:<48}{median[name]:>10.3f}{rate}")
    stock = [median[name] for name in names if name.startswith("dcp.load")]
    best_stock = min(stock) if stock else float("nan")
    ratios = {
        "save blocking, tiers / plain local save":
            median["tiers blocking"] / median["plain blocking"],
        "save committed, tiers / plain local save":
            median["tiers committed"] / median["plain committed"],
        "replication, raw send / tiers": median["raw send"] / median["tiers committed"],
        "restore from the local tier, raw read / restore":
            median["raw read"] / median["restore local"],
        "restore from a replica, raw send / restore":
            median["raw send"] / median["restore replica"],
        "restore from the local tier vs stock dcp.load from the store":
            best_stock / median["restore local"],
        "restore from a replica vs stock dcp.load from the store":
            best_stock / median["restore replica"],
        "restore from the store vs stock dcp.load from the store":
            best_stock / median["restore store"],
        "drain, direct save to the store / drain":
            median["direct save to the store"] / median["drain"],
    }
    if "nvidia-resiliency-ext save (blocking)" in median:
        ratios.update({
            "save blocking vs nvidia-resiliency-ext (synchronous)":
                median["nvidia-resiliency-ext save (blocking)"] / median["tiers blocking"],
            "restore from the local tier vs nvidia-resiliency-ext":
                median["nvidia-resiliency-ext restore local"] / median["restore local"]})
    if "trainer, no saves" in median:
        ratios["trainer step time, saving every step / no saves"] = (
            median["trainer, saving every step"] / median["trainer, no saves"])
    print()
    for name, ratio in ratios.items():
        target = TARGETS.get(name)
        verdict = ""
        if target is not None:
            sign, bound = target
            met = ratio <= bound if sign == "<=" else ratio >= bound
            verdict = f"  (target {sign} {bound:g}: {'met' if met else 'NOT met'})"
        print(f"{name:<64}{ratio:>8.2f}x{verdict}")
    for note in ranks[0]["notes"].items():
        print(f"{note[0]}: {note[1]}")
    return {"world_size": world, "ranks_per_node": args.ranks_per_node,
            "nbytes_per_rank": nbytes, "target": args.target, "median_s": median,
            "rounds_s": rounds, "ratios": ratios, "notes": ranks[0]["notes"],
            "replica_sources": ranks[0]["notes"].get("replica sources")}


def main(argv: list[str] | None = None) -> int:
    from asynctron._launch import run_local_ranks
    from asynctron.testing.seaweedfs import SeaweedFS

    parser = argparse.ArgumentParser(prog="asynctron bench tiers",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks to spawn")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node")
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size, all ranks")
    parser.add_argument("--target", default=os.getcwd(),
                        help="where the local tiers (and the plain save) go")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer-steps", type=int, default=30,
                        help="steps of each trainer run (0: skip the trainer)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.nproc, args.ranks_per_node, args.size_gib, args.repeats = 2, 1, 0.02, 1
        args.trainer_steps = min(args.trainer_steps, 4)
    if args.nproc % args.ranks_per_node or args.nproc // args.ranks_per_node < 2:
        parser.error("--nproc must be whole nodes of --ranks-per-node, at least two")
    started = time.time()
    base = _results.scratch_dir(f"asynctron-bench-tiers-{os.getpid()}-", args.target)
    with tempfile.TemporaryDirectory(prefix="asynctron-bench-store-") as data, \
            SeaweedFS.start(data) as server:
        os.environ.update(server.environment())
        try:
            outcomes = run_local_ranks(_rank, args.nproc, args, base,
                                       f"s3://{server.bucket}/tiers", timeout_s=3600)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    if failed := [r for r in outcomes if r.failed]:
        print(f"asynctron bench tiers: rank {failed[0].rank} failed (exit code "
              f"{failed[0].exitcode}):\n{failed[0].error}", flush=True)
        return 1
    summary = report([r.value for r in outcomes], args)
    summary["meta"] = _results.run_meta(started, args, torch=torch.__version__)
    _results.write_results("tiers", summary, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
