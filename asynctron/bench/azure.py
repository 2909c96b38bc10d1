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

import asyncio
import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from asynctron.bench import _results, _store_bench
from asynctron.bench._s3_measure import measure_method, rank_state
from asynctron.bench._s3_methods import (
    OURS,
    AsynctronMethod,
    DcpMethod,
    Job,
    Method,
    PartBody,
    RawMethod,
    RequestSlots,
)
from asynctron.bench._store_bench import StoreBench

RAW = "raw blocks"
FSSPEC = "DCP FsspecWriter (adlfs)"
METHODS = (RAW, FSSPEC, OURS)
PEERS = (FSSPEC,)
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
    flight at most (counted in `slots`). `RawMethod` (bench.s3's) drives it."""

    def __init__(self, service: Any, *, part_bytes: int, num_requests: int) -> None:
        self._service = service
        self._part_bytes = part_bytes
        self.slots = RequestSlots(num_requests)

    def _blob(self, url: str) -> Any:
        return self._service.get_blob_client(*_split_url(url))

    async def put(self, url: str, view: memoryview) -> None:
        """Store `view` as the blob `url`: blocks of a part each, then the block list."""
        blob = self._blob(url)

        async def stage(block_id: str, offset: int) -> None:
            body = view[offset:offset + self._part_bytes]
            async with self.slots.slot():  # sent in 1 MiB views: the part whole, aiohttp copies it
                await blob.stage_block(block_id, PartBody(body), length=body.nbytes)

        block_ids = [f"{number:06d}" for number in range(
            max(1, -(-view.nbytes // self._part_bytes)))]  # the SDK base64-encodes them
        async with asyncio.TaskGroup() as group:
            for number, block_id in enumerate(block_ids):
                group.create_task(stage(block_id, number * self._part_bytes))
        async with self.slots.slot():
            await blob.commit_block_list(block_ids)

    async def get_into(self, url: str, view: memoryview) -> None:
        """Fill `view` with the blob's first `view.nbytes` bytes, a ranged download per part."""
        blob = self._blob(url)

        async def get(offset: int) -> None:
            length = min(self._part_bytes, view.nbytes - offset)
            async with self.slots.slot():
                download = await blob.download_blob(offset=offset, length=length,
                                                    max_concurrency=1)
                found = await download.readinto(_ViewWriter(view[offset:offset + length]))
            if found != length:
                raise OSError(f"blob {url}: {found} bytes at {offset}, expected {length}")

        async with asyncio.TaskGroup() as group:
            for offset in range(0, view.nbytes, self._part_bytes):
                group.create_task(get(offset))


class AdlfsDcpMethod(DcpMethod):
    """`dcp.save`/`dcp.load` with DCP's fsspec writer and reader on adlfs (`abfs://`)."""

    def _writer_reader(self, url: str, writing: bool) -> Any:
        return self.fsspec("abfs://" + url.split("://", 1)[1], writing,
                           connection_string=os.environ["AZURE_STORAGE_CONNECTION_STRING"],
                           blocksize=self.job.part_bytes)


async def _measure(rank: int, job: Job, state: dict[str, torch.Tensor],
                   warmup: dict[str, torch.Tensor]) -> dict[str, Any]:
    from asynctron import Engine

    async def run(method: Method) -> dict[str, Any]:
        return await measure_method(rank, job, method, state, warmup)

    connection_string = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    if job.method == FSSPEC:
        return await run(AdlfsDcpMethod(job, job.method))
    if job.method == OURS:
        from asynctron.storage.backends.azure import AzureBackend, AzureConfig

        backend = AzureBackend(AzureConfig(connection_string=connection_string))
        async with Engine(backend=backend) as engine:
            return await run(AsynctronMethod(engine, backend.client, collective=False))
    from azure.storage.blob.aio import BlobServiceClient

    async with BlobServiceClient.from_connection_string(
            connection_string, max_single_get_size=job.part_bytes,
            max_chunk_get_size=job.part_bytes, max_block_size=job.part_bytes) as service:
        raw = RawAzure(service, part_bytes=job.part_bytes, num_requests=job.num_requests)
        return await run(RawMethod(raw, rank))  # type: ignore[arg-type]


def _run_rank(rank: int, world: int, job: Job) -> dict[str, Any]:
    """A spawned rank's run of `job` (a module-level function: it is pickled)."""
    import uvloop

    warnings.filterwarnings("ignore", category=ResourceWarning)
    state = rank_state(rank, job.state_bytes, seed=100)
    warmup = rank_state(rank, job.warmup_bytes, seed=7)
    return uvloop.run(_measure(rank, job, state, warmup))


# --------------------------------------------------------------------------------------
# The run: server and containers (bench._store_bench runs the rounds)
# --------------------------------------------------------------------------------------


class _Containers:
    """A container per run, from the connection string's account."""

    def __init__(self, service: Any) -> None:
        self._service = service

    def create(self, name: str) -> None:
        self._service.create_container(name)

    def delete(self, name: str) -> None:
        self._service.delete_container(name)


@contextlib.contextmanager
def _containers(server: Any) -> Iterator[_Containers]:
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(server.connection_string) as service:
        yield _Containers(service)


def _start_azurite(folder: str) -> Any:
    from asynctron.testing.azurite import Azurite

    return Azurite.start(folder)


def _azurite_version() -> dict[str, str]:
    """The version in Azurite's package.json, found above `azurite-blob`'s script."""
    from asynctron.testing.azurite import azurite_binary

    folder = os.path.dirname(os.path.realpath(azurite_binary()))
    while os.path.dirname(folder) != folder:
        with contextlib.suppress(OSError, ValueError, KeyError):
            with open(os.path.join(folder, "package.json")) as f:
                package = json.load(f)
            if package.get("name") == "azurite":
                return {"azurite": str(package["version"])}
        folder = os.path.dirname(folder)
    return {"azurite": "unknown"}


BENCH = StoreBench(
    name="azure", title="Azure Blob", server_name="Azurite",
    server_description="Azurite (azurite-blob, one Node.js process)", scheme="az",
    methods=METHODS, raw=RAW, peers=PEERS, needs=_NEEDS,
    distributions=("azure-storage-blob", "azure-core", "aiohttp", "adlfs", "fsspec"),
    run_rank=_run_rank, start_server=_start_azurite, rooms=_containers,
    server_versions=_azurite_version, quick_part_mib=5)


def main(argv: list[str] | None = None) -> int:
    return _store_bench.main(BENCH, _results.description(__doc__), argv)


if __name__ == "__main__":
    raise SystemExit(main())
