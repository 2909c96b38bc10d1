"""The drain: a complete step's shards, from the local tiers' files, committed to the store as
one ordinary asynctron checkpoint (what `asynctron.load`, the DCP reader, `inspect` and
`verify` read).

Stages, every rank at once, on the drain's own collectives:
1. the coordinator (rank 0) starts the store's save (its claim; a named area every rank
   finds), and broadcasts whether it could;
2. every rank uploads its shard's store files as they are (no staging, no re-encoding: read
   in slab-sized chunks through the staging pool, sent as they are read; the placement gave
   each item one store writer in the job) and its view (its structure, its stored items);
3. the coordinator merges the views into the checkpoint's manifest (every item once, every
   tensor whole: checked before the commit) and commits the store's checkpoint with the
   store's commit protocol (the manifest last, `keep_store` pruning), or discards it if any
   rank failed; every rank learns the outcome.
A drain killed anywhere leaves no checkpoint in the store: the next commit under its root
removes what it left.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from asynctron._concurrency import first_error
from asynctron.engine._collectives import Collectives
from asynctron.engine._coordinator import describe
from asynctron.engine._resources import SaveResources
from asynctron.engine.tiers._layout import join, rank_view, step_name
from asynctron.engine.tiers._placement import part_of
from asynctron.engine.tiers._stream import Chunk, open_shard
from asynctron.errors import PeerError
from asynctron.storage import Committed, Manifest, Retention, SaveArea, store_operation
from asynctron.storage.backends import (
    CheckpointStorage,
    FileStorage,
    ReadableFile,
    SaveStorage,
    commit_checkpoint,
)
from asynctron.storage.format import (
    MANIFEST_NAME,
    encode_manifest,
    merge_structures,
    parse_manifest,
)

logger = logging.getLogger(__name__)

_CHUNKS_IN_FLIGHT = 4
"""Slab-sized chunks of one file read and sent at once (one upload call: parts in flight)."""


@dataclass(frozen=True, slots=True)
class _ShardReport:
    """What a rank uploaded: its shard's manifest, or why it could not."""

    rank: int
    manifest: bytes | None
    error: str | None


async def drain_step(step: int, *, shard: str, collectives: Collectives,
                     local: CheckpointStorage, local_files: FileStorage,
                     store: CheckpointStorage, store_root: str, resources: SaveResources,
                     retention: Retention | None) -> Committed:
    """Drain this rank's `shard` of `step` into the store's checkpoint of `step`, with every
    other rank (collective on `collectives`).

    Raises:
        StorageError: this rank's upload, or (on the coordinator) the commit, failed.
        PeerError: another rank failed; nothing was committed.

    Cancellation: this rank's uploads stop (aborted); the collectives run to their end (the
    other ranks wait in them), reporting it failed; nothing is committed.
    """
    final = join(store_root, step_name(step))
    area = store.area_of(final, name=f"drain-{step}")
    with store_operation("drain", final):
        start_error: Exception | None = None
        if collectives.rank == 0:
            try:
                await store.start_save(area)
            except Exception as error:  # every rank must reach the broadcast
                start_error = error
        started = await collectives.broadcast_object(
            None if start_error is None else describe(start_error), src=0)
        if start_error is not None:
            raise start_error
        if started is not None:
            raise PeerError(f"drain of step {step} to {final}: rank 0 could not start it: "
                            f"{started}", rank=0)
        own_error: BaseException | None = None
        manifest: bytes | None = None
        try:
            manifest = await _upload(shard, collectives.rank, local, local_files, store, area,
                                     resources)
        except (Exception, asyncio.CancelledError) as error:  # reported, then raised
            own_error = error
        report = _ShardReport(collectives.rank, manifest, None if own_error is None
                              else describe(own_error))
        reports = await collectives.gather_object(report, dst=0)
        committed = Committed()
        commit_error: Exception | None = None
        if collectives.rank == 0:
            assert reports is not None
            committed, commit_error = await _commit(store, area, reports, retention, step)
        outcome = await collectives.broadcast_object(
            None if commit_error is None else describe(commit_error), src=0)
        if own_error is not None:
            raise own_error
        if commit_error is not None:
            raise commit_error
        if outcome is not None:
            raise PeerError(f"drain of step {step} to {final}: expected every rank to upload "
                            f"its shard, found {outcome}; nothing was committed", rank=None)
        return committed


async def _upload(shard: str, rank: int, local: CheckpointStorage, local_files: FileStorage,
                  store: SaveStorage, area: SaveArea, resources: SaveResources) -> bytes:
    """Upload the store files of the committed `shard` (rank `rank`'s) into `area`, and its
    view (the files together); returns the view."""
    manifest = await open_shard(local, shard)
    assert manifest.shard is not None
    stored = manifest.shard.store_files
    view = await resources.run_blocking(functools.partial(part_of, manifest, stored,
                                                          stored=True))
    try:
        async with asyncio.TaskGroup() as group:
            for name in stored:
                group.create_task(_upload_file(join(shard, name), name, manifest.files[name],
                                               local_files, store, area, resources))
            group.create_task(_upload_bytes(rank_view(rank), view, store, area))
    except BaseExceptionGroup as error:
        raise first_error(error) from None
    return view


async def _upload_bytes(name: str, data: bytes, store: SaveStorage, area: SaveArea) -> None:
    """A small file (a rank's view) into `area`, durable."""
    writer = store.open_writer(area, name, len(data), direct_io=False, checksums=None)
    try:
        await writer.open()
        await writer.write([Chunk(0, len(data), memoryview(data))] if data else [],
                           lambda _: None)
    finally:
        await writer.aclose()


async def _upload_file(path: str, name: str, nbytes: int, local_files: FileStorage,
                       store: SaveStorage, area: SaveArea, resources: SaveResources) -> None:
    run_blocking, pool = resources.run_blocking, resources.pool
    writer = store.open_writer(area, name, nbytes, direct_io=True, checksums=None)
    source = await run_blocking(local_files.open_file, path)
    try:
        await writer.open()
        offset = 0
        while not writer.done:
            chunks = -(-(nbytes - offset) // pool.slab_bytes)
            slabs = await pool.acquire(min(chunks, _CHUNKS_IN_FLIGHT)) if chunks else []
            try:
                batches = await run_blocking(_read_chunks, source, offset, nbytes,
                                             [slab.view for slab in slabs])
                offset += sum(batch.nbytes for batch in batches)
                await writer.write(batches, lambda _: None)
            finally:
                for slab in slabs:
                    pool.release(slab)
    finally:
        await run_blocking(source.close)
        await writer.aclose()


def _read_chunks(source: ReadableFile, offset: int, nbytes: int,
                 views: Sequence[memoryview]) -> list[Chunk]:
    """Blocks: read the file from `offset` into `views`, one chunk each (up to `nbytes`)."""
    chunks = []
    for view in views:
        size = min(view.nbytes, nbytes - offset)
        if size <= 0:
            break
        got = source.pread_into(view[:size], offset)
        if got != size:
            raise OSError(f"file {source!r}: expected {size} bytes at offset {offset}, found "
                          f"{got}; the shard changed while it was drained")
        chunks.append(Chunk(offset, size, view[:size]))
        offset += size
    return chunks


async def _commit(store: SaveStorage, area: SaveArea, reports: Sequence[_ShardReport],
                  retention: Retention | None, step: int) -> tuple[Committed, Exception | None]:
    """On the coordinator: commit the merged manifest if every rank uploaded, else discard."""
    committed_here = False
    try:
        failed = [report for report in reports if report.manifest is None]
        if failed:
            return Committed(), PeerError(
                f"drain of step {step}: rank {failed[0].rank} failed: {failed[0].error}",
                rank=failed[0].rank)
        manifests = [report.manifest for report in reports if report.manifest is not None]
        try:
            committed = await commit_checkpoint(
                store, area, lambda: {MANIFEST_NAME: merge_manifests(manifests)},
                retention=retention, seq=step, move_latest=True)
        except Exception as error:
            return Committed(), error
        committed_here = True
        return committed, None
    finally:
        if not committed_here:
            await store.discard(area)


def merge_manifests(views: Sequence[bytes]) -> bytes:
    """Blocks (CPU): one manifest of the ranks' views of one step (each item is in one view:
    its store writer's), the structures merged.

    Raises:
        CorruptCheckpointError: the views do not make a whole checkpoint (a tensor not
            covered, an item twice), naming the key.
    """
    parsed: list[Manifest] = [parse_manifest(raw, "<drained view>") for raw in views]
    files: dict[str, int] = {}
    for manifest in parsed:
        files.update(manifest.files)
    structure = merge_structures([json.dumps(m.structure, separators=(",", ":"))
                                  for m in parsed])
    merged = encode_manifest(structure=structure,
                             items=[item for manifest in parsed for item in manifest.items],
                             checksums=None, files=files,
                             created_unix_s=min(m.created_unix_s for m in parsed),
                             checksum=parsed[0].checksum)
    parse_manifest(merged, "<the store's manifest of the drained step>")
    return merged
