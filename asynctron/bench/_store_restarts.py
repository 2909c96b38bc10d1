"""Restarts from the store (`asynctron bench s3 --ranks N`): every rank of a job loads the same
checkpoint from the store at once, as a restarting job does.

For a data-parallel state (DDP: every tensor replicated, each rank needs every byte) and an
FSDP2 state (`fully_shard`: each byte needed by one rank), both with AdamW's state from
`get_state_dict`, the time to every rank loaded (between barriers: the slowest rank's) and
the bytes read from the store per job (counted by the proxies), of:
- asynctron's collective `load_into` (the job's engine started before, as a trainer's is),
  each stored item read once per job and sent to the ranks that need it (`share_reads`, the
  default on object stores), and each rank reading its own (`share_reads=False`, as before);
- stock `dcp.load` with s3torchconnector's reader and with s3fs's (`FsspecReader`);
- the floor: the checkpoint's bytes fetched once by raw ranged GETs (aiobotocore, spread over
  the ranks), then, for the replicated state, all-gathered to every rank (gloo, in 32 MiB
  pieces per rank).
Each through the remote-store profile (one `ShapingProxy` per node, as each node has its own
link to the store) and on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib.util
import json
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from asynctron import Engine

MiB = 1 << 20
GiB = 1 << 30
OURS = "asynctron, shared reads"
OURS_UNSHARED = "asynctron, each rank its own"
S3TORCH = "dcp.load (s3torchconnector)"
FSSPEC = "dcp.load (FsspecReader, s3fs)"
FLOOR = "floor (raw GETs once, then all-gather)"
FLOOR_GETS = "of which the raw GETs"
METHODS = (FLOOR, OURS, OURS_UNSHARED, S3TORCH, FSSPEC)
LAYOUTS = ("ddp", "fsdp")
_RANGE_BYTES = 32 * MiB
_RANGES_IN_FLIGHT = 8
_GATHER_BYTES = 32 * MiB
"""The floor all-gathers the shares in pieces of this size per rank (the bytes moved are the
same; the memory, a piece per rank, not the whole checkpoint)."""


@dataclass(frozen=True, slots=True)
class RestartConfig:
    ranks_per_node: int
    size_gib: float
    repeats: int
    bucket: str
    endpoint: str
    """The store's own endpoint (loopback)."""
    proxied: tuple[str, ...]
    """Each node's endpoint through its remote-store proxy."""
    board: str
    """The folder where rank 0 asks the parent for the proxies' byte counts."""
    warmup: bool = True
    """Run each method once, untimed, before its timed rounds."""


class ProxyBoard:
    """In the parent: answers rank 0's requests for the proxies' counts (a file per request,
    in `folder`), so the ranks can count the bytes each method read through them."""

    def __init__(self, folder: str, proxies: list[Any]) -> None:
        self._folder, self._proxies = folder, proxies
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="proxy-board", daemon=True)

    def __enter__(self) -> ProxyBoard:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _serve(self) -> None:
        while not self._stop.wait(0.002):
            for name in os.listdir(self._folder):
                if not name.startswith("ask-"):
                    continue
                counts = [asdict(proxy.statistics()) for proxy in self._proxies]
                answer = os.path.join(self._folder, f"answer-{name[4:]}")
                with open(answer + ".tmp", "w") as file:
                    json.dump(counts, file)
                os.rename(answer + ".tmp", answer)
                os.remove(os.path.join(self._folder, name))


def _proxy_down_bytes(board: str) -> int:
    """Rank 0: the bytes every proxy has handed to its clients so far."""
    ticket = uuid.uuid4().hex
    open(os.path.join(board, f"ask-{ticket}"), "w").close()
    answer = os.path.join(board, f"answer-{ticket}")
    while not os.path.exists(answer):
        time.sleep(0.001)
    with open(answer) as file:
        counts = json.load(file)
    os.remove(answer)
    return sum(count["down_bytes"] for count in counts)


def measure(rank: int, world: int, config: RestartConfig) -> dict[str, Any]:
    """A spawned rank: every layout, every method, through the proxies and on loopback."""
    import uvloop

    os.environ["ASYNCTRON_RANKS_PER_NODE"] = str(config.ranks_per_node)
    return uvloop.run(_measure(rank, world, config))


async def _measure(rank: int, world: int, config: RestartConfig) -> dict[str, Any]:
    from asynctron.bench._fsdp_job import fsdp_job, local_shards
    from asynctron.bench._s3_endpoint import s3_backend
    from asynctron.testing.layouts import full_digests, full_nbytes

    node = rank // config.ranks_per_node
    results: dict[str, Any] = {}
    for layout in LAYOUTS:
        job = (fsdp_job(config.size_gib, config.ranks_per_node) if layout == "fsdp"
               else _replicated_job(config.size_gib))
        state = job.state()
        nbytes = full_nbytes(state)
        url = f"s3://{config.bucket}/restarts/{layout}"
        await _save(state, url, config.endpoint)
        expected = full_digests(state)
        found: dict[str, Any] = {"state_bytes": nbytes, "times": {}, "store_bytes": {}}
        for link in ("proxied", "loopback"):
            endpoint = config.proxied[node] if link == "proxied" else config.endpoint
            async with contextlib.AsyncExitStack() as stack:  # a job's engine outlives loads
                engines = {method: await stack.enter_async_context(Engine(
                    backend=s3_backend(endpoint), share_reads=method == OURS,
                    coordination_timeout_s=600)) for method in (OURS, OURS_UNSHARED)}
                for method in METHODS:
                    if method == S3TORCH and importlib.util.find_spec("s3torchconnector") is None:
                        continue
                    name = f"{method}, {link}"
                    for round_index in range(config.repeats + int(config.warmup)):
                        for tensor in local_shards(state).values():
                            tensor.detach().zero_()
                        before = _proxy_down_bytes(config.board) if rank == 0 else 0
                        elapsed, fetched_s = await _timed(functools.partial(
                            _load, method, state, url, endpoint, layout, engines))
                        if rank == 0 and link == "proxied":
                            found["store_bytes"][name] = (_proxy_down_bytes(config.board)
                                                          - before)
                        if round_index >= int(config.warmup):
                            found["times"].setdefault(name, []).append(elapsed)
                            if fetched_s is not None:
                                found["times"].setdefault(f"{FLOOR_GETS}, {link}", []).append(
                                    fetched_s)
                        if method != FLOOR and full_digests(state) != expected:
                            raise AssertionError(f"{name}: {layout} state differs from the "
                                                 "saved")
        results[layout] = found
        job = state = None  # the next layout's state takes its memory
        gc.collect()
    return results


def _replicated_job(size_gib: float) -> Any:
    """A data-parallel job's state: the model and AdamW's state of about `size_gib` GiB, the
    same on every rank, as DDP holds it (not wrapped in DDP here: its gradient buckets would
    cost a third more memory per rank, which this VM's eight ranks cannot spare)."""
    from asynctron.bench._fsdp_job import block_shape
    from asynctron.testing.layouts import Block, Job

    width, depth = block_shape(size_gib)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
    job = Job("ddp", model, torch.optim.AdamW(model.parameters(), lr=1e-2), width)
    job.init_optimizer_state()
    return job


async def _timed(work: Callable[[], Awaitable[float | None]]) -> tuple[float, float | None]:
    """`work()`'s time between barriers, and what it returned."""
    await asyncio.to_thread(dist.barrier)
    started = time.perf_counter()
    value = await work()
    elapsed = time.perf_counter() - started
    await asyncio.to_thread(dist.barrier)
    return elapsed, value


async def _save(state: dict[str, Any], url: str, endpoint: str) -> None:
    """The state saved by asynctron (loopback) and by stock `dcp.save` (s3fs), once."""
    import torch.distributed.checkpoint as dcp

    from asynctron.bench._s3_endpoint import fsspec, s3_backend

    async with Engine(backend=s3_backend(endpoint), coordination_timeout_s=600) as engine:
        await engine.save(state, f"{url}/asynctron")
    await asyncio.to_thread(dcp.save, state, storage_writer=fsspec(f"{url}/dcp", endpoint,
                                                                   writing=True))


async def _load(method: str, state: dict[str, Any], url: str, endpoint: str, layout: str,
                engines: dict[str, Engine]) -> float | None:
    """One load of every rank by `method` (asynctron's through the job's running engine);
    the floor's: the time its GETs took (every rank's, between barriers)."""
    import torch.distributed.checkpoint as dcp

    from asynctron.bench._s3_endpoint import fsspec, s3torch

    if method in engines:
        await engines[method].load_into(state, f"{url}/asynctron", collective=True)
    elif method == S3TORCH:
        await asyncio.to_thread(dcp.load, state, storage_reader=s3torch(f"{url}/dcp", endpoint))
    elif method == FSSPEC:
        await asyncio.to_thread(dcp.load, state,
                                storage_reader=fsspec(f"{url}/dcp", endpoint, writing=False))
    else:
        return await _floor(f"{url}/asynctron", endpoint, replicated=layout == "ddp")
    return None


async def _floor(url: str, endpoint: str, *, replicated: bool) -> float:
    """The checkpoint's data objects fetched once by ranged GETs, this rank its share of the
    bytes; then (`replicated`) every rank's share all-gathered to every rank. Returns the
    time until every rank had fetched its share."""
    started = time.perf_counter()
    from aiobotocore.session import get_session
    from botocore.config import Config

    rank, world = dist.get_rank(), dist.get_world_size()
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    config = Config(s3={"addressing_style": "path", "payload_signing_enabled": False},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    max_pool_connections=_RANGES_IN_FLIGHT)
    async with get_session().create_client(
            "s3", endpoint_url=endpoint, region_name=os.environ["AWS_REGION"],
            config=config) as client:
        listed = await client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
        objects = sorted((item["Key"], item["Size"]) for item in listed.get("Contents", ())
                         if not item["Key"].endswith(".json"))
        ranges = [(key, start, min(start + _RANGE_BYTES, size)) for key, size in objects
                  for start in range(0, size, _RANGE_BYTES)]
        mine = ranges[rank::world]
        share = max(1, max(sum(end - start for _, start, end in ranges[r::world])
                           for r in range(world)))
        part = torch.empty(share, dtype=torch.uint8)
        view = memoryview(part.numpy())
        offsets, at = [], 0
        for _, start, end in mine:
            offsets.append(at)
            at += end - start
        slots = asyncio.Semaphore(_RANGES_IN_FLIGHT)

        async def get(item: tuple[str, int, int], offset: int) -> None:
            key, start, end = item
            async with slots:
                response = await client.get_object(Bucket=bucket, Key=key,
                                                    Range=f"bytes={start}-{end - 1}")
                async with response["Body"] as body:
                    data = await body.read()
            view[offset:offset + len(data)] = data

        await asyncio.gather(*(get(item, offset) for item, offset in zip(mine, offsets,
                                                                         strict=True)))
    await asyncio.to_thread(dist.barrier)
    fetched_s = time.perf_counter() - started
    if replicated:  # every rank's share to every rank, a piece at a time (bounded memory)
        gathered = [torch.empty(_GATHER_BYTES, dtype=torch.uint8) for _ in range(world)]
        for start in range(0, share, _GATHER_BYTES):
            piece = part[start:start + _GATHER_BYTES]
            await asyncio.to_thread(dist.all_gather, [g[:piece.numel()] for g in gathered],
                                    piece)
    return fetched_s


def run(*, ranks: int, ranks_per_node: int, size_gib: float, repeats: int,
        store_profile: str, warmup: bool = True) -> list[dict[str, Any]]:
    """Start the store (SeaweedFS) and a proxy per node, run every rank; each rank's
    results (raises the first rank's failure)."""
    import tempfile

    from asynctron._launch import run_local_ranks
    from asynctron.testing import ShapingProxy, StoreProfile
    from asynctron.testing.seaweedfs import SeaweedFS

    profile = StoreProfile.parse(store_profile)
    nodes = ranks // ranks_per_node
    with tempfile.TemporaryDirectory(prefix="asynctron-bench-store-") as data, \
            tempfile.TemporaryDirectory(prefix="asynctron-bench-board-") as board, \
            SeaweedFS.start(data) as server:
        os.environ.update(server.environment())
        host, _, port = server.endpoint.removeprefix("http://").partition(":")
        proxies = [ShapingProxy.start(host, int(port), profile) for _ in range(nodes)]
        config = RestartConfig(ranks_per_node=ranks_per_node, size_gib=size_gib,
                               repeats=repeats, bucket=server.bucket, endpoint=server.endpoint,
                               proxied=tuple(proxy.endpoint for proxy in proxies), board=board,
                               warmup=warmup)
        try:
            with ProxyBoard(board, proxies):
                outcomes = run_local_ranks(measure, ranks, config, timeout_s=3600)
        finally:
            for proxy in proxies:
                proxy.stop()
    return [outcome.unwrap() for outcome in outcomes]


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layout: each method's median time (the slowest rank's each round), the bytes it
    read from the store per job against the state's size, and the targets' ratios."""
    summary: dict[str, Any] = {}
    for layout in LAYOUTS:
        first = ranks[0][layout]
        times = {name: sorted(max(rank[layout]["times"][name][i] for rank in ranks)
                              for i in range(len(first["times"][name])))
                 for name in first["times"]}
        median = {name: values[len(values) // 2] for name, values in times.items()}
        size = first["state_bytes"]
        ratios: dict[str, float] = {}
        for link in ("proxied", "loopback"):
            ours = median.get(f"{OURS}, {link}")
            for peer in (S3TORCH, FSSPEC, OURS_UNSHARED):
                other = median.get(f"{peer}, {link}")
                if ours and other:
                    ratios[f"{peer} / {OURS}, {link}"] = other / ours
            floor = median.get(f"{FLOOR}, {link}")
            if ours and floor:
                ratios[f"{OURS} speed / floor, {link}"] = floor / ours
            gets = median.get(f"{FLOOR_GETS}, {link}")
            if ours and gets:
                ratios[f"{OURS} speed / the floor's raw GETs alone, {link}"] = gets / ours
        summary[layout] = {
            "state_bytes": size, "median_s": median, "rounds_s": times,
            "store_bytes_over_state": {name: value / size
                                       for name, value in first["store_bytes"].items()},
            "ratios": ratios}
    return summary


def report(summary: dict[str, Any], world: int, profile: str) -> None:
    for layout, found in summary.items():
        print(f"\n== restart from the store, {world} ranks, {layout} state "
              f"{found['state_bytes'] / GiB:.2f} GiB; proxied: {profile} ==")
        print(f"{'method':58} {'median s':>9} {'store bytes / state':>20}")
        for name, seconds in found["median_s"].items():
            read = found["store_bytes_over_state"].get(name)
            print(f"{name:58} {seconds:9.2f} "
                  f"{'' if read is None else f'{read:.2f}x':>20}")
        for name, value in found["ratios"].items():
            print(f"  {name}: {value:.2f}x")
