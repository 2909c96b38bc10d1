"""Reading a committed checkpoint: the manifest, item bytes into caller buffers, or mmaps.

`CheckpointReader.open` validates the manifest and every file's size before any item is read,
so truncation is reported up front, naming the file and the first item it cuts.

`CheckpointReader.read` reads many items at once: one task per file; in each file the wanted
items, in file order, are grouped into *read batches* of at most `slab_bytes` (neighbours
closer than `MAX_GAP_BYTES` share a batch), and each batch is ONE executor call: one `preadv`
straight into the destinations (the padding between items goes to a scratch sink), then the
digest of each piece. So a checkpoint of thousands of small items costs few calls, and a large
item streams in calls of `slab_bytes`.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asynctron._concurrency import RunBlocking, first_error
from asynctron.errors import CorruptCheckpointError
from asynctron.storage._checksum import ItemHasher, check_digest, digest
from asynctron.storage._dcp import METADATA_NAME, is_dcp_checkpoint, read_dcp_manifest
from asynctron.storage._manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ItemRecord,
    Manifest,
    parse_manifest,
)
from asynctron.storage.backends.local import _sysio
from asynctron.storage.backends.local._locks import DirLock
from asynctron.storage.backends.local._publish import resolve_checkpoint
from asynctron.storage.backends.local._sysio import FileIO

#: Items closer than this in a file are read in one call (the gap is read and dropped).
MAX_GAP_BYTES = 64 << 10
_SINK = memoryview(bytearray(MAX_GAP_BYTES))


def read_manifest(checkpoint: str) -> Manifest:
    """Blocks: read, parse and validate `checkpoint/manifest.json` (or, for a stock DCP
    checkpoint, its `.metadata`); check that every file has its recorded size and that no two
    items of a file overlap."""
    manifest_path = os.path.join(checkpoint, MANIFEST_NAME)
    if not _sysio.is_file(manifest_path) and is_dcp_checkpoint(checkpoint):
        manifest = read_dcp_manifest(checkpoint)
        _check_no_overlap(manifest, os.path.join(checkpoint, METADATA_NAME))
        return manifest
    manifest = parse_manifest(_sysio.read_small_file(manifest_path, MAX_MANIFEST_BYTES),
                              manifest_path)
    for name, expected in manifest.files.items():
        path = os.path.join(checkpoint, name)
        if not _sysio.exists(path):
            raise CorruptCheckpointError(
                f"file {path}: expected {expected} bytes, found no file; the checkpoint lost "
                "a file after commit", path=path)
        found = _sysio.data_file_size(path)
        if found != expected:
            cut = [i.key for i in manifest.items if i.file == name and i.offset + i.nbytes > found]
            raise CorruptCheckpointError(
                f"file {path}: expected {expected} bytes, found {found}; items "
                f"{cut[:3]} are cut (the file was truncated or changed after commit)",
                path=path, key=cut[0] if cut else None, offset=found)
    _check_no_overlap(manifest, manifest_path)
    return manifest


def _check_no_overlap(manifest: Manifest, manifest_path: str) -> None:
    by_file: dict[str, list[ItemRecord]] = {}
    for record in manifest.items:
        if record.nbytes:
            by_file.setdefault(record.file, []).append(record)
    for name, records in by_file.items():
        records.sort(key=lambda r: r.offset)
        for before, after in itertools.pairwise(records):
            if before.offset + before.nbytes > after.offset:
                raise CorruptCheckpointError(
                    f"manifest {manifest_path}: items {before.key!r} and {after.key!r} overlap "
                    f"in {name} at offset {after.offset}; the checkpoint is damaged or not an "
                    "asynctron checkpoint", path=manifest_path, key=after.key,
                    offset=after.offset)


@dataclass(frozen=True, slots=True)
class ReadSegment:
    """Bytes [item_offset, +nbytes) of job `item_index` land at [batch_offset, +nbytes) of
    its read batch."""

    item_index: int
    item_offset: int
    batch_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """File bytes [file_offset, +nbytes), read by one preadv; bytes no segment covers are
    read into a scratch sink."""

    file_offset: int
    nbytes: int
    segments: tuple[ReadSegment, ...]


@dataclass(frozen=True, slots=True)
class ReadJob:
    """Read `record`'s bytes into `destination` (exactly `record.nbytes`), or, with
    `destination` None, only hash them (verification)."""

    record: ItemRecord
    destination: memoryview | None


def plan_reads(records: Sequence[ItemRecord], slab_bytes: int) -> list[ReadBatch]:
    """Read batches for `records` (all of one file, sorted by offset, not overlapping); a
    segment's `item_index` is its record's index in `records`."""
    batches: list[ReadBatch] = []
    start = end = 0
    segments: list[ReadSegment] = []

    def flush() -> None:
        if segments:
            batches.append(ReadBatch(start, end - start, tuple(segments)))
            segments.clear()

    for index, record in enumerate(records):
        done = 0
        while done < record.nbytes:
            at = record.offset + done
            if not segments or at - end > MAX_GAP_BYTES or at - start >= slab_bytes:
                flush()
                start = end = at
            nbytes = min(record.nbytes - done, start + slab_bytes - at)
            segments.append(ReadSegment(index, done, at - start, nbytes))
            done += nbytes
            end = at + nbytes
    flush()
    return batches


def read_batch(fio: FileIO, fd: int, path: str, batch: ReadBatch, jobs: Sequence[ReadJob],
               hashers: Sequence[ItemHasher] | None, scratch: memoryview | None) -> None:
    """Blocks: one preadv for the whole batch into the jobs' destinations (or `scratch`, which
    holds `batch.nbytes`, for jobs without one), then continue each segment's digest."""
    buffers: list[memoryview] = []
    views: list[memoryview] = []
    cursor = 0
    for segment in batch.segments:
        gap = segment.batch_offset - cursor
        if gap:
            buffers.append(_SINK[:gap])
        job = jobs[segment.item_index]
        if job.destination is not None:
            view = job.destination[segment.item_offset:segment.item_offset + segment.nbytes]
        else:
            assert scratch is not None
            view = scratch[segment.batch_offset:segment.batch_offset + segment.nbytes]
        buffers.append(view)
        views.append(view)
        cursor = segment.batch_offset + segment.nbytes
    def key_at(file_offset: int) -> str:
        cut = [s for s in batch.segments if batch.file_offset + s.batch_offset <= file_offset]
        return jobs[(cut or batch.segments)[-1].item_index].record.key

    _sysio.read_fully(fio, fd, buffers, batch.file_offset, path, key_at)
    if hashers is not None:
        for segment, view in zip(batch.segments, views, strict=True):
            hashers[segment.item_index].update(view)


def read_range(fio: FileIO, fd: int, path: str, key: str, offset: int, destination: memoryview,
               hasher: ItemHasher | None) -> None:
    """Blocks: read `destination.nbytes` bytes at `offset`, and continue `hasher` over them."""
    _sysio.read_fully(fio, fd, [destination], offset, path, lambda _: key)
    if hasher is not None:
        hasher.update(destination)


class CheckpointReader:
    """Reads items of one committed checkpoint; call `aclose` when done.

    Concurrency: several `read` calls may run at once; together they read at most
    `max_files_at_once` files at a time.
    """

    def __init__(self, fio: FileIO, path: str, run_blocking: RunBlocking, *,
                 max_files_at_once: int, lease: DirLock | None = None) -> None:
        self._fio = fio
        self._lease = lease
        self._run_blocking = run_blocking
        self._file_slots = asyncio.Semaphore(max_files_at_once)
        self.requested_path = path
        self.path = path
        self.manifest: Manifest | None = None
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}

    async def open(self) -> Manifest:
        """Find the checkpoint (following `latest`), read and validate its manifest.

        Raises:
            CheckpointNotFoundError: nothing committed at the path.
            CorruptCheckpointError: a bad manifest, or a file of the wrong size.
        """
        self.path = await self._run_blocking(resolve_checkpoint, self.requested_path)
        self.manifest = await self._run_blocking(read_manifest, self.path)
        return self.manifest

    @property
    def verifiable(self) -> bool:
        """Whether the checkpoint carries checksums to verify."""
        assert self.manifest is not None, "open() first"
        return self.manifest.checksum is not None

    def path_of(self, name: str) -> str:
        """The full name of the checkpoint's file `name` (for messages)."""
        return os.path.join(self.path, name)

    def file_path(self, record: ItemRecord) -> str:
        return self.path_of(record.file)

    async def fd(self, name: str) -> int:
        """The open descriptor of data file `name` (opened on first use, closed by `aclose`)."""
        if name not in self._fds:
            await self._run_blocking(self._open_file, name)
        return self._fds[name]

    def _open_file(self, name: str) -> None:
        """Blocks: open `name` and register it in the thread itself, so a cancelled caller
        leaves no descriptor unowned (`aclose` closes it)."""
        fd = _sysio.open_read(self._fio, os.path.join(self.path, name))
        if self._fds.setdefault(name, fd) != fd:  # another task opened it meanwhile
            _sysio.close(self._fio, fd, name)

    async def read(self, jobs: Sequence[ReadJob], *, verify: bool, slab_bytes: int,
                   progress: Callable[[int], None] | None = None
                   ) -> list[CorruptCheckpointError]:
        """Read every job (one task per file, file order within it).

        Returns:
            with `verify` (and a checkpoint that has checksums), one error per item whose
            digest differs, naming file, key and offset; else an empty list. Jobs whose
            record has no checksum (part of an item, read when resharding) are not checked.

        Raises:
            CorruptCheckpointError: a file ends early (names the file and item).
            StorageError: a read failed.

        Memory: jobs without a destination share one scratch buffer of `slab_bytes` per file
        being read, so at most `max_files_at_once` buffers at once.
        Cancellation: the executor call in flight finishes; destinations are partly filled.
        """
        check = verify and self.verifiable
        by_file: dict[str, list[int]] = {}
        for index, job in enumerate(jobs):
            by_file.setdefault(job.record.file, []).append(index)
        found: dict[int, str] = {}

        async def read_file(name: str, indices: list[int]) -> None:
            async with self._file_slots:
                await read_one_file(name, indices)

        async def read_one_file(name: str, indices: list[int]) -> None:
            indices.sort(key=lambda i: jobs[i].record.offset)
            file_jobs = [jobs[i] for i in indices]
            hashers = [ItemHasher() for _ in file_jobs] if check else None
            fd = await self.fd(name)
            path = os.path.join(self.path, name)
            scratch = (memoryview(bytearray(slab_bytes))
                       if any(job.destination is None for job in file_jobs) else None)
            for batch in plan_reads([job.record for job in file_jobs], slab_bytes):
                await self._run_blocking(read_batch, self._fio, fd, path, batch, file_jobs,
                                         hashers, scratch)
                if progress is not None:
                    progress(sum(segment.nbytes for segment in batch.segments))
            if hashers is not None:
                for i, hasher in zip(indices, hashers, strict=True):
                    found[i] = hasher.hexdigest()

        try:
            async with asyncio.TaskGroup() as group:
                for name, indices in by_file.items():
                    group.create_task(read_file(name, indices))
        except BaseExceptionGroup as error:
            raise first_error(error)  # noqa: B904 (the group stays as __context__)
        return [error for i in sorted(found) if jobs[i].record.checksum is not None
                and (error := self.digest_error(jobs[i].record, found[i])) is not None]

    def digest_error(self, record: ItemRecord, found: str) -> CorruptCheckpointError | None:
        """The error for `record` if `found` is not its digest, else None."""
        assert record.checksum is not None
        try:
            check_digest(key=record.key, path=self.file_path(record), offset=record.offset,
                         expected=record.checksum, found=found)
        except CorruptCheckpointError as error:
            return error
        return None

    async def read_range(self, record: ItemRecord, start: int, destination: memoryview,
                         hasher: ItemHasher | None) -> None:
        """Read `record`'s bytes [start, +destination.nbytes) into `destination` (one executor
        call), continuing `hasher` over them."""
        fd = await self.fd(record.file)
        await self._run_blocking(read_range, self._fio, fd, self.file_path(record), record.key,
                                 record.offset + start, destination, hasher)

    async def map(self, record: ItemRecord) -> memoryview:
        """A copy-on-write memory map of the item's bytes; no byte is read until touched."""
        if record.file not in self._maps:
            fd = await self.fd(record.file)
            self._maps[record.file] = await self._run_blocking(_map_file, fd,
                                                               self.file_path(record))
        return memoryview(self._maps[record.file])[record.offset:record.offset + record.nbytes]

    async def check_mapped(self, record: ItemRecord, view: memoryview) -> None:
        """Hash a mapped item (reading every page of it) and raise if it differs."""
        if record.checksum is None:
            return
        error = self.digest_error(record, await self._run_blocking(digest, view))
        if error is not None:
            raise error

    async def read_file(self, name: str, max_bytes: int) -> bytes:
        """The whole small file `name` of the checkpoint (DCP's `.metadata`).

        Raises:
            CorruptCheckpointError: it is larger than `max_bytes`, a link, or not a file.
            StorageError: no such file, or the read failed.
        """
        return await self._run_blocking(_sysio.read_small_file, os.path.join(self.path, name),
                                         max_bytes)

    async def aclose(self) -> None:
        """Close every file and end the lease. Maps stay valid for as long as tensors use
        them."""
        fds, self._fds = self._fds, {}
        try:
            for name, fd in fds.items():
                await self._run_blocking(_sysio.close, self._fio, fd, name)
        finally:
            if self._lease is not None:
                self._lease.release()


def _map_file(fd: int, path: str) -> mmap.mmap:
    """Blocks: map a whole file copy-on-write (writes to the map never reach the file)."""
    with _sysio.translate_os_errors("mapping", path):
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
