"""`NodeCatalog`: one step's shards in a node's tier, open as one checkpoint.

A node's tier holds, for a step, the shards its ranks wrote and the replicas they keep. Each
is a part of the step (`storage.ShardInfo`): together they hold one copy of every item the
node's ranks need (the placement wrote each once per node), and the replicas the items of
other nodes that no other node has. The catalog lists their items as one collection (an item
in two shards once), reads each through its own shard's reader, and answers, for a box of a
tensor a rank wants, which chunks cover it, or that it holds no whole copy of it. Shards are
opened as they are needed, nearest first: an FSDP2 rank's own shard holds all it needs.

A shard that is missing, damaged or not a shard is left out (said in `skipped`): what it held
then comes from another tier.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from asynctron.engine._coordinator import describe
from asynctron.engine.tiers._layout import join, shard_name
from asynctron.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from asynctron.storage import ItemRecord, Manifest
from asynctron.storage.backends import CheckpointReader, CheckpointStorage, MappedItems
from asynctron.storage.format import ChunkIndex, ItemHasher, Overlap, ReadJob, Structure

logger = logging.getLogger(__name__)

SHARD_FAILURES = (CorruptCheckpointError, CheckpointNotFoundError, StorageError,
                  FileNotFoundError)
"""What makes a shard (or a copy of an item) unusable here: the next tier serves instead."""


class NodeCatalog:
    """The items of step `step` (saved by `world_size` ranks) in one node's tier, read
    through their shards' readers (an `ItemReader`); `aclose` when done.

    Its shards are opened when needed, in the order given (a rank's own first): `open_until`
    stops once a condition holds (what the rank needs is covered), `open_all` opens the rest
    (before it serves another node). A shard that cannot be opened is logged (by rank
    `rank`), added to `skipped` and left out.
    """

    def __init__(self, storage: CheckpointStorage, root: str, ranks: Sequence[int], *,
                 step: int, world_size: int, max_files_at_once: int, skipped: list[str],
                 rank: int) -> None:
        self.step = step
        self.world_size = world_size
        self.path = f"{root} (step {step})"
        self.structures: dict[int, Structure] = {}
        """The saved structure of each rank whose shard (or replica) is open here, by rank."""
        self._storage = storage
        self._root = root
        self._pending = list(ranks)
        """The ranks whose shards are not opened yet, in order."""
        self._max_files_at_once = max_files_at_once
        self._skipped = skipped
        self._rank = rank
        self._readers: list[CheckpointReader] = []
        self._reader_of: dict[str, CheckpointReader] = {}
        """Each file's shard reader, by file name (a file name is its writer's: unique)."""
        self._records: dict[str, list[ItemRecord]] = {}
        self._seen: set[tuple[str, tuple[int, ...] | None]] = set()
        self._indexes: dict[str, ChunkIndex] = {}
        self._checksummed = True

    async def open_until(self, enough: Callable[[], bool]) -> None:
        """Open the pending shards in order until `enough()` holds (or none is left)."""
        while self._pending and not enough():
            await self._open(self._pending.pop(0))

    async def open_all(self) -> None:
        await self.open_until(lambda: False)

    async def _open(self, owner: int) -> None:
        path = join(self._root, shard_name(self.step, owner, self.world_size))
        reader = await self._storage.open_reader(path,
                                                 max_files_at_once=self._max_files_at_once)
        try:
            manifest = await reader.open()
            if manifest.shard is None or manifest.shard.rank != owner:
                found = ("a whole checkpoint" if manifest.shard is None
                         else f"rank {manifest.shard.rank}'s")
                raise CorruptCheckpointError(f"shard {path}: expected rank {owner}'s shard, "
                                             f"found {found}", path=path)
        except SHARD_FAILURES as error:
            await reader.aclose()
            skip(self._skipped, self._rank, f"local tier {path}: {describe(error)}")
            return
        self.add(reader, manifest, owner)

    def add(self, reader: CheckpointReader, manifest: Manifest, rank: int) -> None:
        """Take the open shard of `rank` (its reader, now the catalog's to close)."""
        self._readers.append(reader)
        self.structures[rank] = manifest.structure
        self._checksummed = self._checksummed and manifest.checksum is not None
        for name in manifest.files:
            self._reader_of.setdefault(name, reader)
        for record in manifest.items:
            identity = (record.key, record.chunk_offsets)
            if self._reader_of[record.file] is reader and identity not in self._seen:
                self._seen.add(identity)
                self._records.setdefault(record.key, []).append(record)
                self._indexes.pop(record.key, None)

    @property
    def nbytes(self) -> int:
        return sum(record.nbytes for records in self._records.values() for record in records)

    def records(self, key: str) -> list[ItemRecord]:
        return self._records.get(key, [])

    def covering(self, key: str, origin: Sequence[int], shape: Sequence[int]
                 ) -> list[Overlap] | None:
        """The chunks of `key` that overlap the box at `origin` of `shape`, if together they
        cover it whole; else None. (Bytes and 0-dim items: their one record.)"""
        records = self._records.get(key)
        if not records:
            return None
        first = records[0]
        if first.global_shape is None or not first.global_shape:
            return [Overlap(first, (), ())]
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = ChunkIndex(records)
        overlaps = index.overlapping(origin, shape)
        covered = sum(math.prod(h - low for low, h in zip(overlap.lo, overlap.hi, strict=True))
                      for overlap in overlaps)
        return overlaps if covered == math.prod(shape) else None

    def manifest(self) -> Manifest:
        """The catalog's items as a manifest (for a loader): no structure, no files."""
        return Manifest(structure={"dict": []}, files={}, created_unix_s=0.0,
                        checksum="xxh3_64" if self._checksummed else None,
                        items=tuple(record for records in self._records.values()
                                    for record in records))

    # -- ItemReader -------------------------------------------------------------------------

    @property
    def verifiable(self) -> bool:
        return self._checksummed and bool(self._readers)

    def file_path(self, record: ItemRecord) -> str:
        return self._reader_of[record.file].file_path(record)

    async def read(self, jobs: Sequence[ReadJob], *, verify: bool, slab_bytes: int,
                   progress: Callable[[int], None] | None = None
                   ) -> list[CorruptCheckpointError]:
        by_reader: dict[int, list[ReadJob]] = {}
        for job in jobs:
            by_reader.setdefault(id(self._reader_of[job.record.file]), []).append(job)
        errors: list[CorruptCheckpointError] = []
        for reader_jobs in by_reader.values():
            reader = self._reader_of[reader_jobs[0].record.file]
            errors += await reader.read(reader_jobs, verify=verify, slab_bytes=slab_bytes,
                                        progress=progress)
        return errors

    async def read_range(self, record: ItemRecord, start: int, destination: memoryview,
                         hasher: ItemHasher | None) -> None:
        await self._reader_of[record.file].read_range(record, start, destination, hasher)

    def digest_error(self, record: ItemRecord, found: str) -> CorruptCheckpointError | None:
        return self._reader_of[record.file].digest_error(record, found)

    async def map(self, record: ItemRecord) -> memoryview:
        return await self._mapped(record).map(record)

    async def check_mapped(self, record: ItemRecord, view: memoryview) -> None:
        await self._mapped(record).check_mapped(record, view)

    def _mapped(self, record: ItemRecord) -> MappedItems:
        reader = self._reader_of[record.file]
        if not isinstance(reader, MappedItems):
            raise StorageError(f"tier shard {reader.path}: expected files this node maps, "
                               "found a checkpoint on object storage", path=reader.path,
                               errno=None)
        return reader

    async def aclose(self) -> None:
        for reader in self._readers:
            await reader.aclose()
        self._readers.clear()

    def __repr__(self) -> str:
        return (f"<NodeCatalog {self.path}: {len(self._readers)} shards, "
                f"{sum(map(len, self._records.values()))} chunks>")


def skip(skipped: list[str], rank: int, what: str) -> None:
    """Note a copy rank `rank` did not use, and why (logged too)."""
    skipped.append(what)
    logger.warning("restore: rank %d: skipping %s", rank, what)


def saved_keys(structure: Structure) -> set[str]:
    """The item keys a saved structure names."""
    keys: set[str] = set()
    stack: list[Any] = [structure]
    while stack:
        (tag, body), = stack.pop().items()
        if tag == "item":
            keys.add(body)
        elif tag == "dict":
            stack.extend(node for _, node in body)
        elif tag in ("list", "tuple"):
            stack.extend(body)
    return keys
