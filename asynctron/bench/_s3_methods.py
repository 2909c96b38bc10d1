"""The methods `asynctron bench s3` times, as each rank runs them: the raw aiobotocore
baseline (`RawS3`: a multipart PUT of one buffer, ranged GETs into one), `torch.save` plus
upload, stock DCP with the S3 peers' writers and readers, and asynctron's engine; the names
the bench reports them by; and `Job`, one method's run on every rank. The Azure and GCS
benches reuse them."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asynctron.bench import _baselines

GiB = 1 << 30
MiB = 1 << 20
RAW = "raw multipart (unsigned)"
RAW_SIGNED = "raw multipart (signed + checksums)"
S3TORCH = "s3torchconnector DCP"
FSSPEC = "DCP FsspecWriter (s3fs)"
TORCH_SAVE = "torch.save + upload"
OURS = "asynctron"
METHODS = (RAW, RAW_SIGNED, S3TORCH, FSSPEC, TORCH_SAVE, OURS)
RAW_ONE = "raw multipart, one process"
"""With several ranks: the raw baseline moving every rank's bytes from one process."""
BUDGET_4 = "asynctron, request budget 4"
THROTTLED = "asynctron, store throttles beyond 4"
PROXY_BUDGET_4 = "asynctron, budget 4 via proxy"
PROXY_THROTTLED = "asynctron, proxy throttles beyond 4"
PROXY_METHODS = (PROXY_BUDGET_4, PROXY_THROTTLED)
THROTTLE_METHODS = (BUDGET_4, THROTTLED, *PROXY_METHODS)
"""The throttled scenario (`--throttle-gib`), with 503s from two sources: the store's own
circuit breaker answering 503 to every read and write beyond 4 in flight (`THROTTLED`),
against the same save with a budget of 4 and no throttle (`BUDGET_4`); and a `ShapingProxy`
answering 503 SlowDown to every request beyond 4 in flight, after reading its body
(`PROXY_THROTTLED`), against a budget of 4 through the same proxy, which it never refuses
(`PROXY_BUDGET_4`: the proxy counts a request until its answer has gone to the client)."""
THROTTLE_LIMIT = 4
PEERS = (S3TORCH, FSSPEC, TORCH_SAVE)
_CHECKSUM_KEYS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1",
                  "ChecksumSHA256")


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """One method's run on every rank: what to save where, and the methods' settings."""

    method: str
    url: str
    """`s3://bucket/run`: the run's fresh bucket (`az://container/run` in `bench.azure`)."""
    state_bytes: int
    """Bytes of state per rank."""
    warmup_bytes: int
    part_bytes: int
    num_requests: int
    num_threads: int
    max_requests: int | None = None
    """asynctron's request budget (None: its default)."""
    collective: bool = False
    """asynctron loads with `collective=True` (every rank, one listing)."""


# --------------------------------------------------------------------------------------
# In each rank: the methods
# --------------------------------------------------------------------------------------


def _split_url(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def _client_config(*, signed: bool, num_requests: int) -> Any:
    from botocore.config import Config

    if signed:  # botocore's defaults over http: payload SHA-256 and CRC32 checksums
        return Config(s3={"addressing_style": "path"}, max_pool_connections=num_requests)
    return Config(s3={"addressing_style": "path", "payload_signing_enabled": False},
                  request_checksum_calculation="when_required",
                  response_checksum_validation="when_required",
                  max_pool_connections=num_requests)


class PartBody:
    """A part's bytes as a request body that aiohttp sends in 1 MiB views, under backpressure,
    and botocore can read (to hash it, when signing or checksumming), with no copy for sending.

    Given the part whole (bytes, or a memoryview), aiohttp on Python < 3.12.9 joins the request
    headers with the first body chunk, `b"".join`: a copy of the whole part on the loop thread,
    held while the socket drains it (measured here: 0.65-1.3 s loop stalls, RSS growing by
    every part in flight). Only the first 1 MiB view is joined this way.
    """

    CHUNK_BYTES = MiB

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._position = 0

    def __len__(self) -> int:  # botocore's Content-Length
        return self._view.nbytes

    def __aiter__(self) -> Any:  # aiohttp's AsyncIterablePayload; every send starts over
        return self._chunks()

    async def _chunks(self) -> Any:
        for offset in range(0, self._view.nbytes, self.CHUNK_BYTES):
            yield self._view[offset:offset + self.CHUNK_BYTES]

    def read(self, size: int | None = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else self._position + size
        data = bytes(self._view[self._position:end])
        self._position += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        self._position = (offset, self._position + offset, self._view.nbytes + offset)[whence]
        return self._position

    def tell(self) -> int:
        return self._position


class RequestSlots:
    """A raw client's requests: at most `num_requests` in flight, the most there were counted
    (`most_in_flight`)."""

    def __init__(self, num_requests: int) -> None:
        self._budget = asyncio.Semaphore(num_requests)
        self._in_flight = 0
        self.most_in_flight = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One request in flight, while the budget allows."""
        async with self._budget:
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)
            try:
                yield
            finally:
                self._in_flight -= 1


async def copy_chunks(stream: Any, view: memoryview, offset: int, end: int, url: str) -> None:
    """Fill `view[offset:end]` from an aiohttp `StreamReader`, each chunk as it arrived (one
    copy, as a raw client makes it)."""
    while offset < end:
        chunk, _ = await stream.readchunk()
        if not chunk:
            raise OSError(f"object {url}: ended at {offset}, expected {end}")
        view[offset:offset + len(chunk)] = chunk
        offset += len(chunk)


class RawS3:
    """One aiobotocore client on the running loop: a multipart PUT of one buffer and ranged GETs
    into one buffer, `num_requests` requests in flight at most (counted in `slots`)."""

    def __init__(self, client: Any, *, part_bytes: int, num_requests: int):
        self._client = client
        self._part_bytes = part_bytes
        self.slots = RequestSlots(num_requests)

    async def _request(self, operation: str, **params: Any) -> Any:
        async with self.slots.slot():
            return await getattr(self._client, operation)(**params)

    async def put(self, url: str, view: memoryview) -> None:
        """Store `view` as the object `url`: one PUT up to a part, else a multipart upload."""
        bucket, key = _split_url(url)
        if view.nbytes <= self._part_bytes:
            await self._request("put_object", Bucket=bucket, Key=key, Body=PartBody(view))
            return
        upload_id = (await self._client.create_multipart_upload(Bucket=bucket, Key=key)
                     )["UploadId"]

        async def part(number: int, offset: int) -> dict[str, Any]:
            response = await self._request(
                "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                Body=PartBody(view[offset:offset + self._part_bytes]))
            return {"PartNumber": number, "ETag": response["ETag"],
                    **{name: response[name] for name in _CHECKSUM_KEYS if name in response}}

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(part(number, offset)) for number, offset in
                         enumerate(range(0, view.nbytes, self._part_bytes), start=1)]
            await self._request("complete_multipart_upload", Bucket=bucket, Key=key,
                                UploadId=upload_id,
                                MultipartUpload={"Parts": [task.result() for task in tasks]})
        except BaseException:
            await self._client.abort_multipart_upload(Bucket=bucket, Key=key,
                                                      UploadId=upload_id)
            raise

    async def size(self, url: str) -> int:
        bucket, key = _split_url(url)
        return int((await self._request("head_object", Bucket=bucket, Key=key)
                    )["ContentLength"])

    async def get_into(self, url: str, view: memoryview) -> None:
        """Fill `view` with the object's first `view.nbytes` bytes, a ranged GET per part."""
        bucket, key = _split_url(url)

        async def get(offset: int) -> None:
            end = min(offset + self._part_bytes, view.nbytes)
            async with self.slots.slot():
                response = await self._client.get_object(Bucket=bucket, Key=key,
                                                          Range=f"bytes={offset}-{end - 1}")
                async with response["Body"] as body:
                    await copy_chunks(body.raw_stream.content, view, offset, end, url)

        async with asyncio.TaskGroup() as group:
            for offset in range(0, view.nbytes, self._part_bytes):
                group.create_task(get(offset))


class Method:
    """A method in one rank: `setup` (neither timed nor counted in its memory), `prepare`
    (untimed, counted in the save's memory), `save` (returns the caller's blocking seconds, or
    None when that is the whole call), `load` (into the template's tensors, or fresh ones;
    returns the flat loaded state)."""

    def __init__(self) -> None:
        self.extra: dict[str, float] = {}

    async def setup(self, state: dict[str, torch.Tensor]) -> None:
        pass

    async def prepare(self, state: dict[str, torch.Tensor]) -> None:
        pass

    async def save(self, state: dict[str, torch.Tensor], url: str) -> float | None:
        raise NotImplementedError

    async def load(self, template: dict[str, torch.Tensor], url: str
                   ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def most_in_flight(self) -> int | None:
        return None


class RawMethod(Method):
    """The baseline: the state packed into one buffer (untimed), uploaded as one object per
    rank; loaded into a prefaulted buffer whose views are the tensors."""

    def __init__(self, raw: RawS3, rank: int) -> None:
        super().__init__()
        self.raw, self.rank = raw, rank

    async def setup(self, state: dict[str, torch.Tensor]) -> None:
        buffers = _baselines.state_dict_buffers(state)
        self.packed = np.concatenate(buffers)
        self.landing = np.empty_like(self.packed)
        self.landing[::4096] = 0

    async def save(self, state: dict[str, torch.Tensor], url: str) -> float | None:
        await self.raw.put(f"{url}/rank{self.rank}.bin", memoryview(self.packed))
        return None

    async def load(self, template: dict[str, torch.Tensor], url: str
                   ) -> dict[str, torch.Tensor]:
        await self.raw.get_into(f"{url}/rank{self.rank}.bin", memoryview(self.landing))
        loaded, offset = {}, 0
        flat = torch.from_numpy(self.landing)
        for name, tensor in template.items():
            loaded[name] = flat[offset:offset + tensor.nbytes].view(tensor.dtype).view(
                tensor.shape)
            offset += tensor.nbytes
        return loaded

    def most_in_flight(self) -> int | None:
        return self.raw.slots.most_in_flight


class TorchSaveMethod(Method):
    """`torch.save` into memory, then one multipart upload; load: size, GETs, `torch.load`."""

    def __init__(self, raw: RawS3, rank: int) -> None:
        super().__init__()
        self.raw, self.rank = raw, rank

    async def save(self, state: dict[str, torch.Tensor], url: str) -> float | None:
        def serialize() -> io.BytesIO:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            return buffer

        buffer = await asyncio.to_thread(serialize)
        with buffer.getbuffer() as view:
            await self.raw.put(f"{url}/rank{self.rank}.pt", view)
        return None

    async def load(self, template: dict[str, torch.Tensor], url: str
                   ) -> dict[str, torch.Tensor]:
        key = f"{url}/rank{self.rank}.pt"
        data = bytearray(await self.raw.size(key))
        await self.raw.get_into(key, memoryview(data))
        return await asyncio.to_thread(torch.load, io.BytesIO(data), weights_only=True)

    def most_in_flight(self) -> int | None:
        return self.raw.slots.most_in_flight


class DcpMethod(Method):
    """`dcp.save`/`dcp.load` with a storage writer and reader made per call."""

    def __init__(self, job: Job, method: str) -> None:
        super().__init__()
        self.job, self.method = job, method

    def _writer_reader(self, url: str, writing: bool) -> Any:
        job = self.job
        if self.method == S3TORCH:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

            config = S3ClientConfig(force_path_style=True, part_size=job.part_bytes)
            region = os.environ["AWS_REGION"]
            if writing:
                return S3StorageWriter(region, url, s3client_config=config,
                                       thread_count=job.num_threads)
            return S3StorageReader(region, url, s3client_config=config)
        return self.fsspec(url, writing, endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                           default_block_size=job.part_bytes,
                           client_kwargs={"region_name": os.environ["AWS_REGION"]},
                           config_kwargs={
                               "s3": {"addressing_style": "path",
                                      "payload_signing_enabled": False},
                               "request_checksum_calculation": "when_required",
                               "response_checksum_validation": "when_required",
                               "max_pool_connections": max(10, 2 * job.num_threads)})

    def fsspec(self, url: str, writing: bool, **options: Any) -> Any:
        """DCP's fsspec writer (`--threads` threads, a part copied ahead each, no fsync: an
        object has none) or reader at `url`, its filesystem made with `options`."""
        # torch 2.13 does not re-export them from torch.distributed.checkpoint
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        if writing:
            return FsspecWriter(url, sync_files=False, thread_count=self.job.num_threads,
                                per_thread_copy_ahead=self.job.part_bytes, **options)
        return FsspecReader(url, **options)

    async def save(self, state: dict[str, torch.Tensor], url: str) -> float | None:
        import torch.distributed.checkpoint as dcp

        writer = self._writer_reader(url, writing=True)
        await asyncio.to_thread(dcp.save, state, storage_writer=writer)
        return None

    async def load(self, template: dict[str, torch.Tensor], url: str
                   ) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        reader = self._writer_reader(url, writing=False)
        await asyncio.to_thread(dcp.load, template, storage_reader=reader)
        return template


class AsynctronMethod(Method):
    """One Engine (default settings, but the request budget `max_requests` when given) for the
    process's saves and loads; the store's statistics of each."""

    def __init__(self, engine: Any, client: Any, *, collective: bool) -> None:
        super().__init__()
        self.engine = engine
        self.client = client
        self.collective = collective

    async def prepare(self, state: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        await self.engine.prefault_staging(sum(t.nbytes for t in state.values()))
        self.extra["prefault_s"] = time.perf_counter() - started

    async def save(self, state: dict[str, torch.Tensor], url: str) -> float | None:
        started = time.perf_counter()
        task = self.engine.save(state, f"{url}/step_1")
        self.extra["call_s"] = time.perf_counter() - started
        await task.staged
        blocking = time.perf_counter() - started
        store = (await task).store
        self.extra.update(save_requests=store.num_requests, save_throttled=store.num_throttled)
        return blocking

    async def load(self, template: dict[str, torch.Tensor], url: str
                   ) -> dict[str, torch.Tensor]:
        from asynctron.storage import store_operation

        with store_operation("load") as operation:
            await self.engine.load_into(template, f"{url}/step_1",
                                        collective=self.collective)
        store = operation.statistics()
        self.extra.update(load_requests=store.num_requests, load_throttled=store.num_throttled,
                          load_lists=store.num_lists)
        return template

    def most_in_flight(self) -> int | None:
        return self.client.most_in_flight


