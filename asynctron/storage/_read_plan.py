"""Reading a committed checkpoint, whatever holds it: which bytes to fetch in which calls
(`plan_reads`), and the checks a manifest must pass against the files it names before any item
is read (`check_files`).

A read batch is one storage call (a `preadv`, a ranged GET): the wanted items of one file, in
file order, grouped into batches of at most `slab_bytes`; neighbours closer than
`MAX_GAP_BYTES` share a batch (the gap is read and dropped). So thousands of small items cost
few calls, and a large item streams in calls of `slab_bytes`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asynctron._concurrency import RunBlocking, first_error
from asynctron.errors import CorruptCheckpointError
from asynctron.storage._checksum import ItemHasher, check_digest, digest
from asynctron.storage._manifest import ItemRecord, Manifest

#: Items closer than this in a file are read in one call (the gap is read and dropped).
MAX_GAP_BYTES = 64 << 10
_SINK = memoryview(bytearray(MAX_GAP_BYTES))


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

    def targets(self, jobs: Sequence[ReadJob], scratch: memoryview | None
                ) -> tuple[list[memoryview], list[memoryview]]:
        """Where the batch's bytes go, in order (the jobs' destinations, `scratch` for jobs
        without one, a shared sink for the gaps), and each segment's view of them."""
        buffers: list[memoryview] = []
        views: list[memoryview] = []
        cursor = 0
        for segment in self.segments:
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
        return buffers, views

    def hash(self, views: Sequence[memoryview], hashers: Sequence[ItemHasher]) -> None:
        """Blocks (CPU): continue each segment's item digest over its view (`targets`)."""
        for segment, view in zip(self.segments, views, strict=True):
            hashers[segment.item_index].update(view)


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


def check_files(manifest: Manifest, sizes: Callable[[str], int | None],
                path_of: Callable[[str], str]) -> None:
    """Check that every file of `manifest` exists with its recorded size (`sizes(name)`: its
    size, None if missing); the first item a short file cuts is named."""
    for name, expected in manifest.files.items():
        path = path_of(name)
        found = sizes(name)
        if found is None:
            raise CorruptCheckpointError(
                f"file {path}: expected {expected} bytes, found no file; the checkpoint lost "
                "a file after commit", path=path)
        if found != expected:
            cut = [i.key for i in manifest.items if i.file == name and i.offset + i.nbytes > found]
            raise CorruptCheckpointError(
                f"file {path}: expected {expected} bytes, found {found}; items "
                f"{cut[:3]} are cut (the file was truncated or changed after commit)",
                path=path, key=cut[0] if cut else None, offset=found)


def check_no_overlap(manifest: Manifest, manifest_path: str) -> None:
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


class CheckpointReaderBase:
    """What every backend's checkpoint reader shares: the opened manifest and the checks of
    item bytes against it (the I/O is the backend's)."""

    def __init__(self, path: str, run_blocking: RunBlocking) -> None:
        self._run_blocking = run_blocking
        self.requested_path = path
        self.path = path
        """The checkpoint read (after `open`: the one `latest` named, if it was followed)."""
        self.manifest: Manifest | None = None

    def adopt(self, path: str, manifest: Manifest) -> None:
        """Read the checkpoint `path` by `manifest`, found by another process's `open`."""
        self.path, self.manifest = path, manifest

    @property
    def verifiable(self) -> bool:
        """Whether the checkpoint carries checksums to verify."""
        assert self.manifest is not None, "open() first"
        return self.manifest.checksum is not None

    def path_of(self, name: str) -> str:
        """The full name of the checkpoint's file `name` (for messages)."""
        return f"{self.path.rstrip('/')}/{name}"

    def file_path(self, record: ItemRecord) -> str:
        return self.path_of(record.file)

    def digest_error(self, record: ItemRecord, found: str) -> CorruptCheckpointError | None:
        """The error for `record` if `found` is not its digest, else None."""
        assert record.checksum is not None
        try:
            check_digest(key=record.key, path=self.file_path(record), offset=record.offset,
                         expected=record.checksum, found=found)
        except CorruptCheckpointError as error:
            return error
        return None

    async def read(self, jobs: Sequence[ReadJob], *, verify: bool, slab_bytes: int,
                   progress: Callable[[int], None] | None = None
                   ) -> list[CorruptCheckpointError]:
        """Read every job (one task per file, `read_file` for each, its jobs in file order).

        Returns:
            with `verify` (and a checkpoint that has checksums), one error per item whose
            digest differs, naming file, key and offset; else an empty list. Jobs whose
            record has no checksum (part of an item, read when resharding) are not checked.

        Raises:
            CorruptCheckpointError: a file ends early (names the file and item).
            StorageError: a read failed.
        """
        check = verify and self.verifiable
        by_file: dict[str, list[int]] = {}
        for index, job in enumerate(jobs):
            by_file.setdefault(job.record.file, []).append(index)
        found: dict[int, str] = {}

        async def read_file(name: str, indices: list[int]) -> None:
            indices.sort(key=lambda i: jobs[i].record.offset)
            file_jobs = [jobs[i] for i in indices]
            hashers = [ItemHasher() for _ in file_jobs] if check else None
            await self.read_file_jobs(name, file_jobs, hashers, slab_bytes=slab_bytes,
                                      progress=progress)
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

    async def read_file_jobs(self, name: str, jobs: Sequence[ReadJob],
                             hashers: Sequence[ItemHasher] | None, *, slab_bytes: int,
                             progress: Callable[[int], None] | None) -> None:
        """Read `jobs`, all of the file `name` and sorted by offset, in batches of at most
        `slab_bytes` (`plan_reads`), continuing `hashers[i]` over job i's bytes in file
        order; `progress(nbytes)` as bytes land. The backend's I/O."""
        raise NotImplementedError

    async def check_mapped(self, record: ItemRecord, view: memoryview) -> None:
        """Hash a mapped item (reading every page of it) and raise if it differs."""
        if record.checksum is None:
            return
        error = self.digest_error(record, await self._run_blocking(digest, view))
        if error is not None:
            raise error
