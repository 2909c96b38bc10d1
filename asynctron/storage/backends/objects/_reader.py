"""`ObjectReader`: a committed checkpoint on a store, read by parallel ranged GETs straight into
the destinations.

`open` reads `latest` (if the URL is a root), lists the checkpoint's objects once (their
sizes), reads its manifest (asynctron's, or a
stock DCP `.metadata`) with the bounds of a local one, and checks every file's size before any
item is read. `read` plans the same read batches as a local read, cut to at most
`range_bytes`, and sends every GET at once (the client's request budget bounds them); digests
are continued in file order on the executor as ranges land.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from asynctron._concurrency import RunBlocking
from asynctron.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StorageError,
)
from asynctron.storage.backends._reader_base import CheckpointReaderBase
from asynctron.storage.backends.objects._client import ObjectClient
from asynctron.storage.backends.objects._io_loop import touch_pages
from asynctron.storage.backends.objects._layout import LATEST_NAME, ObjectUrl, parse_url
from asynctron.storage.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    METADATA_NAME,
    ItemHasher,
    ItemRecord,
    Manifest,
    ReadJob,
    check_files,
    check_no_overlap,
    parse_dcp_manifest,
    parse_manifest,
    plan_reads,
)

#: The most bytes one ranged GET asks for: enough GETs in flight to fill the link.
RANGE_BYTES = 16 << 20


class ObjectReader(CheckpointReaderBase):
    """Reads items of one committed checkpoint on a store; `aclose` when done.

    No lease: a checkpoint pruned by another process while it is read fails the read with a
    clear error (a missing object), never with wrong bytes (digests are verified).
    """

    def __init__(self, client: ObjectClient, url: str, run_blocking: RunBlocking, *,
                 max_files_at_once: int) -> None:
        super().__init__(url, run_blocking)
        self._client = client
        self._sizes: dict[str, int] = {}
        self._scratch_slots = asyncio.Semaphore(2 * max_files_at_once)
        """Ranges read only to be hashed (verification) in flight at once: each holds a
        scratch buffer of up to `RANGE_BYTES`."""

    async def open(self) -> Manifest:
        """Find the checkpoint (following `latest`), read and check its manifest.

        Raises:
            CheckpointNotFoundError: nothing committed at the URL.
            CorruptCheckpointError: a bad manifest, or an object missing or of another size.
        """
        url = self._parse(self.requested_path)
        named = await self._latest_name(url)
        if named is not None:
            url = url.child(named)
        try:
            sizes = (await self._client.list(url)).sizes
        except ObjectNotFoundError as error:  # no bucket: nothing committed, as locally
            raise CheckpointNotFoundError(f"checkpoint {self.requested_path}: {error}",
                                          path=str(url)) from error
        if MANIFEST_NAME not in sizes and METADATA_NAME not in sizes:
            if named is not None:
                raise CheckpointNotFoundError(
                    f"checkpoint {self.requested_path}: its '{LATEST_NAME}' names {url}, which "
                    f"holds no committed checkpoint ({MANIFEST_NAME} or DCP's "
                    f"{METADATA_NAME}); it was pruned, or its save never committed",
                    path=str(url))
            if not sizes:
                raise CheckpointNotFoundError(
                    f"checkpoint {url}: expected a committed checkpoint, found nothing: no "
                    "object is stored directly under that URL (a wrong URL, or a folder of "
                    f"checkpoints without a '{LATEST_NAME}': name one of them)", path=str(url))
            raise CheckpointNotFoundError(
                f"checkpoint {url}: expected a committed checkpoint ({MANIFEST_NAME} or DCP's "
                f"{METADATA_NAME}) or a '{LATEST_NAME}' object, found neither; the save may not "
                "have committed", path=str(url))
        self.path = str(url)
        self._sizes = sizes
        if MANIFEST_NAME in sizes:
            manifest_path = self.path_of(MANIFEST_NAME)
            raw = await self._get_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
            manifest = await self._run_blocking(parse_manifest, raw, manifest_path)
            check_files(manifest, sizes.get, self.path_of)
        else:
            manifest_path = self.path_of(METADATA_NAME)
            raw = await self._get_small(METADATA_NAME, MAX_METADATA_BYTES)
            manifest = await self._run_blocking(parse_dcp_manifest, raw, self.path, 0.0,
                                                sizes.get)
        await self._run_blocking(check_no_overlap, manifest, manifest_path)
        self.manifest = manifest
        return manifest

    def _parse(self, path: str) -> ObjectUrl:
        return parse_url(path, self._client.schemes)

    async def _latest_name(self, url: ObjectUrl) -> str | None:
        """The checkpoint `url/latest` names, or None if there is no such object (`url` is a
        checkpoint, or nothing): one GET, so that a load lists the store once."""
        latest = url.child(LATEST_NAME)
        try:
            raw = await self._get(latest, 4096)
        except ObjectNotFoundError:
            return None
        name = raw.decode(errors="replace").strip()
        if not name or "/" in name or name in (".", ".."):
            raise CorruptCheckpointError(
                f"object {latest}: expected the name of a checkpoint beside it, found "
                f"{name[:80]!r}", path=str(latest))
        return name

    async def _get_small(self, name: str, max_bytes: int) -> bytes:
        """The checkpoint's small object `name`, checked against the listing first (when this
        reader listed the checkpoint; an adopted one did not)."""
        size = self._sizes.get(name)
        url = self._parse(self.path_of(name))
        if size is None:
            if not self._sizes:
                return await self._get(url, max_bytes)
            raise StorageError(f"object {url}: expected it in the checkpoint, found none",
                               path=str(url), errno=None)
        if size > max_bytes:
            raise CorruptCheckpointError(
                f"object {url}: expected at most {max_bytes} bytes, found {size}; refused "
                "unread (the checkpoint is damaged or not an asynctron checkpoint)",
                path=str(url))
        return await self._get(url, size)

    async def _get(self, url: ObjectUrl, max_bytes: int) -> bytes:
        """The whole object `url`, of at most `max_bytes`.

        Raises:
            CorruptCheckpointError: it is larger (refused unread).
        """
        data, _, size = await self._client.get_small(url, max_bytes)
        if data is None:
            raise CorruptCheckpointError(
                f"object {url}: expected at most {max_bytes} bytes, found {size}; refused "
                "unread", path=str(url))
        return data

    async def read_file_jobs(self, name: str, jobs: Sequence[ReadJob],
                             hashers: Sequence[ItemHasher] | None, *, slab_bytes: int,
                             progress: Callable[[int], None] | None) -> None:
        """Every range of the file in flight at once (the request budget bounds them, each
        at most `RANGE_BYTES`), digests continued in file order on the executor.

        Memory: jobs without a destination (verification) get a scratch buffer per range in
        flight, at most `2 * max_files_at_once` of them.
        Cancellation: the GETs in flight are cancelled; destinations are partly filled.
        """
        url = self._parse(self.path_of(name))
        batches = await self._run_blocking(plan_reads, [job.record for job in jobs],
                                           min(slab_bytes, RANGE_BYTES))  # off the loop
        turns = [asyncio.Event() for _ in batches]

        async def read_batch(number: int) -> None:
            batch = batches[number]
            if any(jobs[s.item_index].destination is None for s in batch.segments):
                async with self._scratch_slots:
                    await read_into(number, memoryview(bytearray(batch.nbytes)))
            else:
                await read_into(number, None)

        async def read_into(number: int, scratch: memoryview | None) -> None:
            batch = batches[number]
            buffers, views = batch.targets(jobs, scratch)
            first = jobs[batch.segments[0].item_index].record.key
            await self._run_blocking(touch_pages, views)
            await self._client.get_into(url, batch.file_offset, buffers, key=first)
            if progress is not None:
                progress(sum(segment.nbytes for segment in batch.segments))
            if hashers is not None:
                if number:
                    await turns[number - 1].wait()
                await self._run_blocking(batch.hash, views, hashers)
            turns[number].set()

        async with asyncio.TaskGroup() as group:
            for number in range(len(batches)):
                group.create_task(read_batch(number))

    async def read_range(self, record: ItemRecord, start: int, destination: memoryview,
                         hasher: ItemHasher | None) -> None:
        """Read `record`'s bytes [start, +destination.nbytes) into `destination` (one ranged
        GET), continuing `hasher` over them."""
        await self._run_blocking(touch_pages, [destination])
        await self._client.get_into(self._parse(self.file_path(record)), record.offset + start,
                                    [destination], key=record.key)
        if hasher is not None:
            await self._run_blocking(hasher.update, destination)

    async def read_file(self, name: str, max_bytes: int) -> bytes:
        """The whole small object `name` of the checkpoint (DCP's `.metadata`).

        Raises:
            CorruptCheckpointError: larger than `max_bytes`.
            StorageError: no such object, or the read failed.
        """
        try:
            return await self._get_small(name, max_bytes)
        except ObjectNotFoundError as error:
            raise StorageError(f"object {self.path_of(name)}: expected it in the checkpoint, "
                               f"found none ({error})", path=self.path_of(name),
                               errno=None) from error

    async def aclose(self) -> None:
        """Nothing is held between reads."""
