"""Azure Blob checkpoint benchmark: asynctron's Azure backend against the raw azure-storage-blob
baseline and DCP's fsspec writer and reader over adlfs, all on ONE local Azure Blob server
(Azurite, `asynctron.testing.azurite`) started by the run, on the same state dict, in one run.
The S3 benchmark (`asynctron.bench.s3`) is its model: its rounds, measures and summary.

Methods (each save timed until the data is durable on the server, i.e. the last request
answered; each load until the bytes are in the caller's tensors):
- `raw blocks`: the physical baseline. The state's bytes, packed into one buffer before the clock
  starts, go out as one block blob from one azure-storage-blob aio client: `stage_block` of
  `--part-mib` blocks, `--requests` in flight on the loop, then one `commit_block_list`; each
  block sent from the buffer in 1 MiB views (bench.s3's `PartBody`: given a whole part, aiohttp
  copies it on the loop thread; measured here: 0.75 s loop stalls, +513 MiB RSS at 1 GiB).
  Loaded with ranged `download_blob(offset, length)` calls of the same size, `--requests` in
  flight, each `readinto` a prefaulted buffer. The SDK's own settings otherwise: its retries
  on, a block and a GET per request.
- `DCP FsspecWriter (adlfs)`: `dcp.save` with `FsspecWriter` on `abfs://container/run`
  (`--threads` threads, adlfs blocks of `--part-mib`, `sync_files=False`: an adlfs file has no
  fsync; the account from the connection string), `dcp.load` with `FsspecReader`.
- `asynctron`: `engine.save(state, "az://container/run/step_1")` and `engine.load_into`, one
  Engine with `AzureBackend(AzureConfig(connection_string=...))` and default settings, staging
  prefaulted as a trainer does at start-up (`engine.prefault_staging`, untimed but counted in
  its memory).
Every (round, method) runs in a fresh process with a fresh container (deleted after), after an
untimed small save and load in the same process (clients, pools and imports warm). Methods take
turns in a shuffled order per round after an untimed warm-up round; medians of the rounds are
reported.

Measured per method, as `asynctron bench s3` does: save and load GB/s, the caller's blocking
time (asynctron: until `await task.staged`), CPU seconds of the client process per GB, the event
loop's worst heartbeat delay during the save and the load (the DCP peer runs via
`asyncio.to_thread`, as an async trainer would call it), peak RSS growth, requests in flight at
most; and the server's (Azurite's) CPU seconds per GB over the method's whole run. Ratios:
asynctron over raw (the issue's target: >= 0.9x, save and load) and over the peer.

Azurite is one Node.js process: on a small machine it, not the client, bounds every method.

Run: `asynctron bench azure` (`python -m asynctron.bench.azure`; 1 GiB, 3 rounds: ~5-10 min on
a 2-core VM); `--dir /dev/shm` keeps the server's data in memory; `--quick` for a smoke run
(tiny state, one round, no warm-up round). Results: printed, and written as JSON (`--out`;
default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import AsyncIterator
from typing import Any

import torch

from asynctron.bench import _baselines, _results, s3
from asynctron.bench._rounds import round_order
from asynctron.bench.s3 import GiB, Job, Method, MiB

RAW = "raw blocks"
FSSPEC = "DCP FsspecWriter (adlfs)"
OURS = s3.OURS
METHODS = (RAW, FSSPEC, OURS)
PEERS = (FSSPEC,)
TARGET_OVER_RAW = 0.9
"""The issue's target: asynctron's save and load throughput over the raw client's, at least."""
_NEEDS = {RAW: ("azure.storage.blob.aio", "pip install 'azure-storage-blob[aio]'"),
          FSSPEC: ("adlfs", "pip install adlfs"),
          OURS: ("asynctron.storage.backends.azure", "pip install 'asynctron[azure]'")}


# --------------------------------------------------------------------------------------
# In each rank: the methods
# --------------------------------------------------------------------------------------


def _split_url(url: str) -> tuple[str, str]:
    container, _, key = url.split("://", 1)[1].partition("/")
    return container, key


class _ViewWriter:
    """A writable stream over a buffer (what `StorageStreamDownloader.readinto` writes to)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._position = 0

    def write(self, data: bytes) -> int:
        self._view[self._position:self._position + len(data)] = data
        self._position += len(data)
        return len(data)


class RawAzure:
    """One azure-storage-blob aio client on the running loop: one buffer staged as blocks and
    committed, and read back with ranged downloads into one buffer, `num_requests` requests in
    flight at most (counted in `most_in_flight`). `RawMethod` (bench.s3's) drives it."""

    def __init__(self, service: Any, *, part_bytes: int, num_requests: int) -> None:
        self._service = service
        self._part_bytes = part_bytes
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

    def _blob(self, url: str) -> Any:
        return self._service.get_blob_client(*_split_url(url))

    async def put(self, url: str, view: memoryview) -> None:
        """Store `view` as the blob `url`: blocks of a part each, then the block list."""
        blob = self._blob(url)

        async def stage(block_id: str, offset: int) -> None:
            body = view[offset:offset + self._part_bytes]
            async with self._slot():  # sent in 1 MiB views: the part whole, aiohttp copies it
                await blob.stage_block(block_id, s3.PartBody(body), length=body.nbytes)

        block_ids = [f"{number:06d}" for number in range(
            max(1, -(-view.nbytes // self._part_bytes)))]  # the SDK base64-encodes them
        async with asyncio.TaskGroup() as group:
            for number, block_id in enumerate(block_ids):
                group.create_task(stage(block_id, number * self._part_bytes))
        async with self._slot():
            await blob.commit_block_list(block_ids)

    async def get_into(self, url: str, view: memoryview) -> None:
        """Fill `view` with the blob's first `view.nbytes` bytes, a ranged download per part."""
        blob = self._blob(url)

        async def get(offset: int) -> None:
            length = min(self._part_bytes, view.nbytes - offset)
            async with self._slot():
                download = await blob.download_blob(offset=offset, length=length,
                                                    max_concurrency=1)
                found = await download.readinto(_ViewWriter(view[offset:offset + length]))
            if found != length:
                raise OSError(f"blob {url}: {found} bytes at {offset}, expected {length}")

        async with asyncio.TaskGroup() as group:
            for offset in range(0, view.nbytes, self._part_bytes):
                group.create_task(get(offset))


class AdlfsDcpMethod(s3.DcpMethod):
    """`dcp.save`/`dcp.load` with DCP's fsspec writer and reader on adlfs (`abfs://`)."""

    def _writer_reader(self, url: str, writing: bool) -> Any:
        # torch 2.13 does not re-export them from torch.distributed.checkpoint
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        job = self.job
        url = "abfs://" + url.split("://", 1)[1]
        options = {"connection_string": os.environ["AZURE_STORAGE_CONNECTION_STRING"],
                   "blocksize": job.part_bytes}
        if writing:
            return FsspecWriter(url, sync_files=False, thread_count=job.num_threads,
                                per_thread_copy_ahead=job.part_bytes, **options)
        return FsspecReader(url, **options)


async def _measure(rank: int, job: Job, state: dict[str, torch.Tensor],
                   warmup: dict[str, torch.Tensor]) -> dict[str, Any]:
    from asynctron import Engine

    async def run(method: Method) -> dict[str, Any]:
        return await s3.measure_method(rank, job, method, state, warmup)

    connection_string = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    if job.method == FSSPEC:
        return await run(AdlfsDcpMethod(job, job.method))
    if job.method == OURS:
        from asynctron.storage.backends.azure import AzureBackend, AzureConfig

        backend = AzureBackend(AzureConfig(connection_string=connection_string))
        async with Engine(backend=backend) as engine:
            return await run(s3.AsynctronMethod(engine, backend.client, collective=False))
    from azure.storage.blob.aio import BlobServiceClient

    async with BlobServiceClient.from_connection_string(
            connection_string, max_single_get_size=job.part_bytes,
            max_chunk_get_size=job.part_bytes, max_block_size=job.part_bytes) as service:
        raw = RawAzure(service, part_bytes=job.part_bytes, num_requests=job.num_requests)
        return await run(s3.RawMethod(raw, rank))  # type: ignore[arg-type]


def _run_rank(rank: int, world: int, job: Job) -> dict[str, Any]:
    """A spawned rank's run of `job` (a module-level function: it is pickled)."""
    import uvloop

    warnings.filterwarnings("ignore", category=ResourceWarning)
    state = s3._rank_state(rank, job.state_bytes, seed=100)
    warmup = s3._rank_state(rank, job.warmup_bytes, seed=7)
    return uvloop.run(_measure(rank, job, state, warmup))


# --------------------------------------------------------------------------------------
# The run: server, containers, rounds, summary
# --------------------------------------------------------------------------------------


def unavailable(method: str) -> str | None:
    """Why `method` cannot run here (a missing client or peer, no Azure backend), or None."""
    module, hint = _NEEDS[method]
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"{module} is not importable ({type(error).__name__}: {error}); {hint}"
    return None


def _cpu_s_of(pid: int) -> float:
    """A process's CPU time so far (user and system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_rounds(server: Any, methods: list[str], args: argparse.Namespace
               ) -> dict[str, list[dict[str, Any]]]:
    """Every method in a fresh process each round (round 0 untimed, but with `--quick`), each
    with a fresh container deleted after; per method, each timed round's results."""
    from azure.storage.blob import BlobServiceClient

    from asynctron._launch import run_local_ranks

    state_bytes = int(args.size_gib * GiB)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}

    def run_one(service: Any, name: str, round_index: int) -> dict[str, Any]:
        container = f"bench-{round_index}-{METHODS.index(name)}"
        service.create_container(container)
        job = Job(method=name, url=f"az://{container}/run", state_bytes=state_bytes,
                  warmup_bytes=min(16 * MiB, max(MiB, state_bytes // 8)),
                  part_bytes=args.part_mib * MiB, num_requests=args.requests,
                  num_threads=args.threads)
        started, server_cpu = time.perf_counter(), _cpu_s_of(server.process.pid)
        try:
            (outcome,) = run_local_ranks(_run_rank, 1, job, timeout_s=300 + state_bytes / 2e6)
            server_cpu = _cpu_s_of(server.process.pid) - server_cpu
        finally:
            service.delete_container(container)
        if outcome.failed:
            raise RuntimeError(f"{name}: its process failed (exit code {outcome.exitcode}):\n"
                               f"{outcome.error}")
        rank = outcome.value
        if not rank["verified"]:
            raise RuntimeError(f"{name}: the loaded state differs from the saved one")
        rank["server_cpu_s"] = server_cpu
        print(f"  round {round_index} {name:<28} save {rank['save_s']:7.2f} s, load "
              f"{rank['load_s']:6.2f} s ({time.perf_counter() - started:.0f} s with start-up; "
              f"Azurite {server_cpu:.1f} CPU s)", flush=True)
        return rank

    with BlobServiceClient.from_connection_string(server.connection_string) as service:
        for round_index in range(int(args.quick), args.repeats + 1):
            for name in round_order(methods, round_index):
                rank = run_one(service, name, round_index)
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
    if "asynctron_over_raw" in result["ratios"]:
        over = result["ratios"]["asynctron_over_raw"]
        result["targets"] = {f"asynctron / raw, {what}": {
            "ratio": over[what], "target": TARGET_OVER_RAW, "met": over[what] >= TARGET_OVER_RAW}
            for what in ("save", "load")}
    return result


def report(result: dict[str, Any]) -> None:
    s3._table(result["methods"], f"Azure Blob checkpoints: {result['nbytes'] / GiB:.2f} GiB "
              f"state ({result['num_tensors']} tensors), one local Azurite")
    print("blocks: until the caller may go on (asynctron: `await task.staged`); CPU: client "
          "process time (every thread) per GB moved; loop: worst heartbeat delay during the "
          "save / the load; RSS+: peak growth (asynctron's save includes its staging slabs); "
          "in flight: most requests at once")
    print("Azurite CPU s per GB moved (save + load): " + ", ".join(
        f"{name} {m['server_cpu_s_per_gb']:.2f}" for name, m in result["methods"].items()))
    for name, target in result.get("targets", {}).items():
        print(f"{name}: {target['ratio']:.2f}x (target >= {target['target']}: "
              f"{'met' if target['met'] else 'NOT met'})")
    for what, best in result["ratios"].get("asynctron_over_fastest_peer", {}).items():
        print(f"asynctron / peer, {what}: {best['ratio']:.2f}x ({best['peer']})")
    for name, reason in result["skipped"].items():
        print(f"not run: {name}: {reason}")


def _versions() -> dict[str, str]:
    versions = {}
    for name in ("torch", "azure-storage-blob", "azure-core", "aiohttp", "adlfs", "fsspec"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _azurite_version(binary: str) -> str:
    """The version in Azurite's package.json, found above `azurite-blob`'s script."""
    folder = os.path.dirname(os.path.realpath(binary))
    while os.path.dirname(folder) != folder:
        with contextlib.suppress(OSError, ValueError, KeyError):
            with open(os.path.join(folder, "package.json")) as f:
                package = json.load(f)
            if package.get("name") == "azurite":
                return str(package["version"])
        folder = os.path.dirname(folder)
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench azure",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--part-mib", type=int, default=32,
                        help="block size of the raw baseline and of adlfs")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests in flight of the raw baseline")
    parser.add_argument("--threads", type=int, default=4, help="FsspecWriter's thread_count")
    parser.add_argument("--only", default=",".join(METHODS),
                        help="comma-separated subset of the methods")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the server keeps its data (/dev/shm: in memory)")
    parser.add_argument("--quick", action="store_true", help="tiny state, one round (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.repeats, args.part_mib = min(args.size_gib, 0.008), 1, 5
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    if unknown := sorted(set(wanted) - set(METHODS)):
        parser.error(f"--only: expected names from {list(METHODS)}, found {unknown}")
    from asynctron.testing.azurite import Azurite, azurite_binary

    started, load_average = time.time(), os.getloadavg()
    skipped = {name: reason for name in wanted if (reason := unavailable(name))}
    for name, reason in skipped.items():
        print(f"asynctron bench azure: skipping {name}: {reason}", flush=True)
    methods = [name for name in wanted if name not in skipped]
    if not methods:
        print("asynctron bench azure: no method left to run", flush=True)
        return 1
    warmed = 0 if args.quick else _baselines.warm_guest_memory()
    base = _results.scratch_dir(f"asynctron-bench-azure-{os.getpid()}-", args.dir)
    saved_env = dict(os.environ)
    try:
        binary = azurite_binary()
        server = Azurite.start(os.path.join(base, "azurite"))
        try:
            os.environ.update(server.environment())  # the spawned ranks inherit it
            rounds = run_rounds(server, methods, args)
        finally:
            server.stop()
    except (FileNotFoundError, RuntimeError) as error:  # no Azurite; a failed start or run
        print(f"asynctron bench azure: {error}", flush=True)
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
        started, args, versions={**_versions(), "azurite": _azurite_version(binary)},
        warmed_guest_memory_bytes=warmed, load_average_start=load_average,
        load_average_end=os.getloadavg(),
        server=f"Azurite (azurite-blob, one Node.js process) on 127.0.0.1, data in {args.dir}")
    _results.write_results("azure", result, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
