"""Reading a committed checkpoint, whatever holds it: which bytes to fetch in which calls
(`plan_reads`), and the checks a manifest must pass against the files it names before any item
is read (`check_files`).

A read batch is one storage call (a `preadv`, a ranged GET): the wanted items of one file, in
file order, grouped into batches of at most `slab_bytes`; neighbours closer than
`MAX_GAP_BYTES` share a batch (the gap is read and dropped). So thousands of small items cost
few calls, and a large item streams in calls of `slab_bytes`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asynctron.errors import CorruptCheckpointError
from asynctron.storage.format._checksum import ItemHasher
from asynctron.storage.format._manifest import ItemRecord, Manifest

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
