"""Loading a committed checkpoint: fresh CPU tensors, in place into the caller's tensors, or mmap.

Every destination that is contiguous CPU memory (a fresh tensor, a shard's part of a saved
chunk, a contiguous `load_into` target) is read straight into, in batched calls
(`ItemReader.read`: one task per file). CUDA and non-contiguous targets go through
budgeted slabs (H2D on the copy stream, waited off the loop). Nothing is ever unpickled: the
structure is JSON and bytes items come back as `bytes`.

Resharding, a rank reads of each saved chunk only the runs its shard holds: a range of rows, or
each row's range of columns when skipping between them saves reading (`Overlap.runs`).

In a collective load with a `ReadShare`, an item several ranks need is read whole by one of
them and sent to the others (`_shared_reads`); the load checks its target first, then agrees
with the other ranks on who reads what, then plans and reads. `into` starts reading the chunks
no other rank can need (inside its box of a DTensor sharded over every rank) before the
agreement.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from asynctron._concurrency import RunBlocking, first_error
from asynctron._memory import tensor_bytes
from asynctron.engine._resources import SaveResources
from asynctron.engine._shared_reads import ReadShare, SharePlan
from asynctron.engine._slab_fill import SlabFill, SlabFiller
from asynctron.engine._slabs import SlabPool
from asynctron.engine._staging import CopyStreams
from asynctron.errors import CorruptCheckpointError, StorageError
from asynctron.storage import ItemRecord, Manifest
from asynctron.storage.backends import ItemReader, MappedItems
from asynctron.storage.format import (
    MAX_GAP_BYTES,
    NUMPY_DTYPES,
    TORCH_DTYPES,
    ChunkIndex,
    FlatStateDict,
    Overlap,
    ReadJob,
    Structure,
    decode_blob,
    flatten,
    tensor_of,
    unflatten,
)

#: (destination, source): bytes read apart, copied into their place once read.
_Placement = tuple[torch.Tensor, torch.Tensor]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Wanted:
    """Part of a saved chunk a target wants: where they meet, the target's local tensor and
    its place in the global tensor."""

    overlap: Overlap
    local: torch.Tensor
    origin: tuple[int, ...]
    exclusive: bool = False
    """The target is a DTensor sharded over every rank of the load (only `Shard`
    placements): no other rank's part of it overlaps this one."""


@dataclass(frozen=True, slots=True)
class _Decode:
    """A `torch.save` blob (stock DCP item) read into `buffer`: decoded after the reads, then
    (its `region`, if given) copied into `target`, or (no target) kept as the key's value."""

    record: ItemRecord
    buffer: bytearray
    target: torch.Tensor | None
    region: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """The [lo, hi) part of the record's chunk (global coordinates) that `target` wants."""


@dataclass(slots=True)
class _Reads:
    """One load's reads, planned off the loop: straight into their destinations (`jobs`),
    through slabs (`staged`: CUDA and strided targets), apart then placed (`partial`), blobs
    to decode (`decodes`); and each key's value (`items`)."""

    items: dict[str, Any] = field(default_factory=dict)
    jobs: list[ReadJob] = field(default_factory=list)
    staged: list[SlabFill] = field(default_factory=list)
    partial: list[_Placement] = field(default_factory=list)
    decodes: list[_Decode] = field(default_factory=list)


def _torch_dtype(record: ItemRecord) -> torch.dtype:
    assert record.dtype is not None
    return (TORCH_DTYPES if record.kind == "tensor" else NUMPY_DTYPES)[record.dtype]


def _is_whole(record: ItemRecord) -> bool:
    return record.shape == record.global_shape and not any(record.chunk_offsets or ())


def _chunk_view(tensor: torch.Tensor, record: ItemRecord) -> torch.Tensor:
    """The part of a full tensor that `record`'s chunk covers."""
    assert record.shape is not None and record.chunk_offsets is not None
    view = tensor
    for dim, (offset, size) in enumerate(zip(record.chunk_offsets, record.shape, strict=True)):
        view = view.narrow(dim, offset, size)
    return view


def _values_by_key(structure: Structure) -> tuple[dict[str, Any], str | None]:
    """Every JSON value in a structure, by the flat key it would have as an item; and the first
    key two values join to (`{"a.b": 1, "a": {"b": 2}}`, which asynctron refuses to save but an
    older checkpoint may hold), or None."""
    values: dict[str, Any] = {}
    aliased: str | None = None
    stack: list[tuple[str, Structure]] = [("", structure)]
    while stack:
        path, node = stack.pop()
        (tag, body), = node.items()
        if tag == "value":
            if path in values and aliased is None:
                aliased = path
            values[path] = body
        elif tag == "dict":
            stack.extend((f"{path}.{k}" if path else str(k), child) for k, child in body)
        elif tag in ("list", "tuple"):
            stack.extend((f"{path}.{i}" if path else str(i), c) for i, c in enumerate(body))
    return values, aliased


class Loader:
    """Loads one checkpoint through the `ItemReader` of an open checkpoint.

    Not constructed directly; `Loads.loader` makes one.
    """

    def __init__(self, reader: ItemReader, manifest: Manifest, *, pool: SlabPool,
                 copy_streams: CopyStreams, run_blocking: RunBlocking, slab_bytes: int,
                 verify: bool, whole_chunks: bool = False, share: ReadShare | None = None):
        self._reader = reader
        self._share = share
        """Across ranks, the load's shared reads (None: this rank reads all it needs)."""
        self.read_bytes = 0
        """The bytes this loader read from the checkpoint's storage (not those another rank
        read for it)."""
        self._manifest = manifest
        self._whole_chunks = whole_chunks
        """Read a saved chunk a target needs only part of whole (so its digest is checked),
        not just the runs the target needs."""
        self._run_blocking = run_blocking
        self._slab_bytes = slab_bytes
        self._verify = verify and reader.verifiable
        self._filler = SlabFiller(reader, pool=pool, copy_streams=copy_streams,
                                  run_blocking=run_blocking, verify=verify)

    async def _agreed(self, check: Callable[[], T], needs: Callable[[T], np.ndarray],
                      checked_first: Callable[[], None] = lambda: None
                      ) -> tuple[T, SharePlan | None]:
        """`check()` (off the loop: it raises where the target does not match the checkpoint)
        and, with a `ReadShare`, the plan every rank agreed on for the records `needs(result)`
        marks (`checked_first()` runs once the check passed, before the agreement). A rank's
        failure there is raised on every rank (as `PeerError` elsewhere)."""
        if self._share is None:
            return await self._run_blocking(check), None
        outcome: np.ndarray | BaseException
        try:
            checked = await self._run_blocking(check)
            checked_first()
            outcome = await self._run_blocking(needs, checked)
        except Exception as error:  # every rank must reach the agreement
            outcome = error
        return checked, await self._share.agree(outcome, self._manifest.items)

    @functools.cached_property
    def _record_index(self) -> dict[int, int]:
        """Each manifest record's place in the manifest, by `id` (made once per load, off
        the loop)."""
        return {id(record): at for at, record in enumerate(self._manifest.items)}

    def _needs(self, reads: _Reads, wanted: Sequence[_Wanted]) -> np.ndarray:
        """Blocks: which of the manifest's records `reads` and `wanted` need."""
        index = self._record_index
        needs = np.zeros(len(self._manifest.items), dtype=bool)
        needs[[index[id(job.record)] for job in reads.jobs]] = True
        needs[[index[id(want.overlap.record)] for want in wanted]] = True
        return needs

    async def _read_jobs(self, jobs: Sequence[ReadJob], plan: SharePlan | None
                         ) -> list[CorruptCheckpointError]:
        """`ItemReader.read` of `jobs`, or with a plan that shares items, the shared read."""
        if plan is None or not plan.readers:
            self.read_bytes += sum(job.record.nbytes for job in jobs)
            return await self._reader.read(jobs, verify=self._verify,
                                           slab_bytes=self._slab_bytes)
        assert self._share is not None
        index = await self._run_blocking(lambda: self._record_index)
        try:
            return await self._share.read(plan, self._manifest.items, index, jobs,
                                          self._reader, verify=self._verify,
                                          slab_bytes=self._slab_bytes)
        finally:
            self.read_bytes += self._share.read_bytes

    async def _fill_slabs(self, staged: Sequence[SlabFill]) -> None:
        self.read_bytes += sum(fill.record.nbytes for fill in staged)
        await self._filler.fill(staged)

    async def _read_all(self, reads: _Reads, plan: SharePlan | None = None) -> None:
        """Read `reads`: its jobs straight into their destinations and its staged targets
        through slabs, at once; then place the chunks read apart and decode the blobs (off
        the loop). Raises the first corrupt item."""

        async def read_direct() -> None:
            errors = await self._read_jobs(reads.jobs, plan)
            if errors:
                raise errors[0]

        try:
            async with asyncio.TaskGroup() as group:
                if reads.jobs or (plan is not None and plan.readers):
                    group.create_task(read_direct())
                if reads.staged:
                    group.create_task(self._fill_slabs(reads.staged))
        except BaseExceptionGroup as error:
            raise first_error(error)  # noqa: B904 (the group stays as __context__)
        await self._run_blocking(_place_chunks, reads.partial)
        if reads.decodes:
            reads.items.update(await self._run_blocking(self._decode_all, reads.decodes))

    def _fresh_jobs(self, records: list[ItemRecord], reads: _Reads) -> Any:
        """A new tensor for the key `records` hold, and the reads that fill it: straight into
        it where a chunk's part of it is contiguous (whole items, row chunks), else into a
        chunk of its own placed afterwards. `torch.save` blobs are read whole and decoded
        (a whole one becomes the value itself: None is returned for it)."""
        first = records[0]
        if first.encoding == "torch_save" and len(records) == 1 and (
                first.kind == "object" or _is_whole(first)):
            reads.decodes.append(_Decode(first, bytearray(first.nbytes), None))
            reads.jobs.append(ReadJob(first, memoryview(reads.decodes[-1].buffer)))
            return None
        assert first.global_shape is not None
        tensor = torch.empty(first.global_shape, dtype=_torch_dtype(first))
        for record in records:
            view = tensor if _is_whole(record) else _chunk_view(tensor, record)
            if record.encoding == "torch_save":
                reads.decodes.append(_Decode(record, bytearray(record.nbytes), view))
                reads.jobs.append(ReadJob(record, memoryview(reads.decodes[-1].buffer)))
            elif view.is_contiguous():
                reads.jobs.append(ReadJob(record, tensor_bytes(view)))
            else:
                assert record.shape is not None
                chunk = torch.empty(record.shape, dtype=_torch_dtype(record))
                reads.jobs.append(ReadJob(record, tensor_bytes(chunk)))
                reads.partial.append((view, chunk))
        return tensor

    async def fresh(self) -> dict[str, Any]:
        """The saved structure with fresh CPU tensors, numpy arrays and bytes."""
        reads, plan = await self._agreed(
            self._plan_fresh, lambda _: np.ones(len(self._manifest.items), dtype=bool))
        await self._read_all(reads, plan)
        return unflatten(self._manifest.structure, self._finish(reads.items))

    def _plan_fresh(self) -> _Reads:
        """Blocks: a fresh value for every key, and the reads that fill them."""
        reads = _Reads()
        for key, records in self._manifest.by_key().items():
            if records[0].kind == "bytes":
                reads.items[key] = bytearray(records[0].nbytes)
                reads.jobs.append(ReadJob(records[0], memoryview(reads.items[key])))
            else:
                reads.items[key] = self._fresh_jobs(records, reads)
        return reads

    def _decode_all(self, decodes: Sequence[_Decode]) -> dict[str, Any]:
        """Blocks: decode every blob; copy tensors into their targets; return the values of
        blobs without a target, by key."""
        values: dict[str, Any] = {}
        for decode in decodes:
            record, path = decode.record, self._reader.file_path(decode.record)
            value = decode_blob(memoryview(decode.buffer), key=record.key, path=path)
            if record.kind == "tensor":
                value = tensor_of(value, record, path)
            if decode.target is None:
                values[record.key] = value
            elif decode.region is None:
                decode.target.copy_(value)
            else:
                assert record.chunk_offsets is not None
                decode.target.copy_(_region(value, *decode.region, origin=record.chunk_offsets))
        return values

    def _finish(self, items: dict[str, Any]) -> dict[str, Any]:
        """Turn loaded payloads into what the caller saved (ndarray, bytes)."""
        kinds = {record.key: record.kind for record in self._manifest.items}
        for key, value in items.items():
            if kinds[key] == "bytes":
                items[key] = bytes(value)
            elif kinds[key] == "ndarray":
                items[key] = value.numpy()
        return items

    async def mapped(self) -> dict[str, Any]:
        """The saved structure with tensors backed by copy-on-write maps of the files.

        An item stored as several chunks (a sharded tensor, or one cut into chunks to spread
        over bins) cannot be one map: it is read into a fresh tensor instead.

        Raises:
            StorageError: the checkpoint is not in files this node maps (an object store).
        """
        reader = self._reader
        if not isinstance(reader, MappedItems):
            raise StorageError(
                f"checkpoint {reader.path}: mmap=True maps local files, and this checkpoint is on "
                "object storage; load with mmap=False (parallel ranged reads), or copy the "
                "checkpoint to a local path to map it", path=reader.path, errno=None)
        reads = _Reads()
        items = reads.items
        for key, records in self._manifest.by_key().items():
            first = records[0]
            if first.encoding == "torch_save" or (
                    first.kind != "bytes" and (len(records) != 1 or not _is_whole(first))):
                items[key] = self._fresh_jobs(records, reads)
                continue
            view = await reader.map(first) if first.nbytes else memoryview(b"")
            if self._verify:
                await reader.check_mapped(first, view)
            if first.kind == "bytes":
                items[key] = bytes(view)
            elif first.nbytes == 0:
                assert first.shape is not None
                items[key] = torch.empty(first.shape, dtype=_torch_dtype(first))
            else:
                assert first.shape is not None
                items[key] = torch.frombuffer(view, dtype=_torch_dtype(first)).view(first.shape)
        await self._read_all(reads)
        return unflatten(self._manifest.structure, self._finish(items))

    async def into(self, target: Mapping[str, Any]) -> dict[str, Any]:
        """Fill `target`'s tensors and arrays in place; return `target`'s structure with
        non-tensor values (and bytes) taken from the checkpoint.

        Raises:
            ValueError: a key of `target` missing from the checkpoint, or a dtype, shape or
                kind that differs (names the key).
            CorruptCheckpointError: two of the checkpoint's values or items join to one key
                (names it).
        """
        early = _Reads()  # read before the agreement: parts of chunks no other rank needs
        reading_early: list[asyncio.Future[None]] = []

        def check() -> tuple[Structure, dict[str, Any], list[str], _Reads, list[_Wanted]]:
            checked = self._check_into(target)
            if self._share is not None:
                checked[4][:] = self._plan_exclusive(checked[4], early)
            return checked

        def read_early() -> None:
            if early.jobs or early.staged:
                reading_early.append(asyncio.ensure_future(self._read_all(early)))

        try:
            (structure, saved_values, object_keys, reads, wanted), plan = await self._agreed(
                check, lambda checked: self._needs(*checked[3:]), read_early)
            await self._run_blocking(self._plan_wanted, wanted, reads, plan)
            await self._read_all(reads, plan)
        except BaseException:
            await asyncio.gather(*reading_early, return_exceptions=True)
            raise
        for task in reading_early:
            await task
        items = reads.items
        saved_values.update((key, items.pop(key)) for key in object_keys)
        for key, value in items.items():
            if isinstance(value, bytearray):
                items[key] = bytes(value)
        return _rebuild(structure, items, saved_values, self._reader.path)

    def _check_into(self, target: Mapping[str, Any]
                    ) -> tuple[Structure, dict[str, Any], list[str], _Reads, list[_Wanted]]:
        """Blocks: check `target` against the checkpoint (raises as `into`): the target's
        structure, the checkpoint's values by key, its pickled ones' keys, the reads of
        whole items and the parts of saved chunks the target wants."""
        flat = flatten(target)
        structure = flat.structure
        by_key = self._manifest.by_key()
        saved_values, aliased = _values_by_key(self._manifest.structure)
        aliased = aliased or next((key for key in saved_values if key in by_key), None)
        if aliased is not None:
            raise CorruptCheckpointError(
                f"checkpoint {self._reader.path}: key {aliased!r} names two values once its "
                "parts are joined, so load_into cannot tell them apart (an older asynctron saved "
                "such keys); load() it to read both", path=self._reader.path,
                key=aliased)
        # A stock DCP checkpoint keeps non-tensor values as pickled items: decode them too.
        object_keys = [key for key in _values_by_key(structure)[0]
                       if key in by_key and by_key[key][0].kind == "object"]
        reads = _Reads()
        for key in object_keys:
            reads.decodes.append(_Decode(by_key[key][0], bytearray(by_key[key][0].nbytes),
                                         None))
            reads.jobs.append(ReadJob(by_key[key][0], memoryview(reads.decodes[-1].buffer)))
        wanted = self._check_keys(flat, flat.values, by_key, reads)
        return structure, saved_values, object_keys, reads, wanted

    async def fill(self, target: FlatStateDict, keys: Collection[str]
                   ) -> tuple[dict[str, bytes], dict[str, str]]:
        """Fill the items `keys` of `target` (flattened) in place from this checkpoint, whose
        chunks cover them (its manifest may be a part of one: a tier's shards).

        Returns:
            the values of bytes items (which cannot be filled in place) by key, and the keys
            whose bytes failed their digest, with why (those targets may be partly filled).

        Raises:
            ValueError: a key missing from the checkpoint, or a dtype, shape or kind that
                differs (names the key).
            StorageError: a read failed.
        """
        (reads, wanted), plan = await self._agreed(
            lambda: self._check_fill(target, keys), lambda checked: self._needs(*checked))
        await self._run_blocking(self._plan_wanted, wanted, reads, plan)
        failed: dict[str, str] = {}

        async def read_direct() -> None:
            for error in await self._read_jobs(reads.jobs, plan):
                failed.setdefault(error.key or "", str(error))

        async def read_staged() -> None:
            try:
                await self._fill_slabs(reads.staged)
            except CorruptCheckpointError as error:  # the others were left unread
                for fill in reads.staged:
                    failed.setdefault(fill.record.key, str(error))

        try:
            async with asyncio.TaskGroup() as group:
                if reads.jobs or (plan is not None and plan.readers):
                    group.create_task(read_direct())
                if reads.staged:
                    group.create_task(read_staged())
        except BaseExceptionGroup as error:
            raise first_error(error)  # noqa: B904 (the group stays as __context__)
        await self._run_blocking(_place_chunks, reads.partial)
        values = {key: bytes(value) for key, value in reads.items.items()
                  if isinstance(value, bytearray) and key not in failed}
        return values, failed

    def _check_fill(self, target: FlatStateDict, keys: Collection[str]
                    ) -> tuple[_Reads, list[_Wanted]]:
        reads = _Reads()
        wanted = self._check_keys(target, {key: target.values[key] for key in keys},
                                  self._manifest.by_key(), reads)
        return reads, wanted

    def _plan_exclusive(self, wanted: Sequence[_Wanted], reads: _Reads) -> list[_Wanted]:
        """Blocks: plan into `reads` the parts of `wanted` that only this rank can need (a
        saved chunk wholly inside an `exclusive` target's box); return the rest."""
        rest = []
        for want in wanted:
            if want.exclusive and want.overlap.covers_record:
                self._plan_overlap(want.overlap, want.local, want.origin, reads, shared=False)
            else:
                rest.append(want)
        return rest

    def _plan_wanted(self, wanted: Sequence[_Wanted], reads: _Reads,
                     plan: SharePlan | None) -> None:
        """Blocks: plan the reads of every part of a saved chunk a target wants (an item
        another rank reads too, whole and through host memory)."""
        shared = frozenset() if plan is None else plan.shared
        index = self._record_index if shared else {}
        for want in wanted:
            self._plan_overlap(want.overlap, want.local, want.origin, reads,
                               shared=index.get(id(want.overlap.record)) in shared)

    def _check_keys(self, flat: FlatStateDict, values: Mapping[str, Any],
                    by_key: Mapping[str, list[ItemRecord]], reads: _Reads) -> list[_Wanted]:
        """Blocks: check each of `values` (items of `flat`) against its saved records (raises
        as `into`); plan the reads of bytes items, and return the parts of saved chunks the
        tensors want."""
        wanted: list[_Wanted] = []
        items, jobs = reads.items, reads.jobs
        for key, value in values.items():
            kind = flat.kinds[key]
            records = by_key.get(key)
            if records is None:
                raise ValueError(f"key {key!r}: expected in checkpoint {self._reader.path}, "
                                 "found no such item; load() it to see its keys")
            first = records[0]
            if first.kind == "object":
                raise ValueError(f"key {key!r}: expected a {kind} as in the state dict, found a "
                                 "pickled Python value in the DCP checkpoint; read it with "
                                 "load()")
            if kind == "bytes" or first.kind == "bytes":
                if kind != first.kind:
                    raise ValueError(f"key {key!r}: expected {kind} (as in the state dict), "
                                     f"found {first.kind} in the checkpoint")
                items[key] = bytearray(first.nbytes)
                jobs.append(ReadJob(first, memoryview(items[key])))
                continue
            assert isinstance(value, torch.Tensor)
            tensor = value.detach()
            if kind == "ndarray" and tensor.data_ptr() != flat.original(key).ctypes.data:
                raise ValueError(f"key {key!r}: an ndarray with negative strides cannot be "
                                 "filled in place; pass a view with positive strides")
            saved_dtype = _torch_dtype(first)
            if tensor.dtype != saved_dtype or tuple(tensor.shape) != first.global_shape:
                raise ValueError(
                    f"key {key!r}: expected {saved_dtype} {list(first.global_shape or ())} as "
                    f"saved, found {tensor.dtype} {list(tensor.shape)} in the state dict; "
                    "load into a matching tensor, or load() it")
            local, origin = target_box(tensor)
            if len(records) == 1 and local is tensor and _is_whole(first):
                overlaps = [Overlap(first, origin, tuple(local.shape))]  # the common case
            else:
                overlaps = ChunkIndex(records).overlapping(origin, tuple(local.shape))
            exclusive = (self._share is not None and isinstance(tensor, DTensor)
                         and tensor.device_mesh.size() == self._share.world_size
                         and all(placement.is_shard() for placement in tensor.placements))
            wanted.extend(_Wanted(overlap, local, origin, exclusive) for overlap in overlaps)
            items[key] = flat.original(key)
        return wanted

    def _plan_overlap(self, overlap: Overlap, local: torch.Tensor, origin: tuple[int, ...],
                      reads: _Reads, *, shared: bool) -> None:
        """How to read the part of a saved chunk a target wants: straight into the target
        where it can be, else through slabs (CUDA, strided) or a piece read apart (a whole
        chunk, when it is `shared`: read by one rank, sent to others)."""
        record = overlap.record
        destination = _region(local, overlap.lo, overlap.hi, origin=origin)
        if record.encoding == "torch_save":
            region = None if overlap.covers_record else (overlap.lo, overlap.hi)
            reads.decodes.append(_Decode(record, bytearray(record.nbytes), destination, region))
            reads.jobs.append(ReadJob(record, memoryview(reads.decodes[-1].buffer)))
            return
        if overlap.covers_record:
            if destination.device.type == "cpu" and destination.is_contiguous() and (
                    tuple(destination.shape) == record.shape):
                reads.jobs.append(ReadJob(record, tensor_bytes(destination)))
            elif not shared:  # CUDA or strided: through budgeted slabs
                reads.staged.append(SlabFill(record, destination))
            else:
                assert record.shape is not None
                chunk = torch.empty(record.shape, dtype=_torch_dtype(record))
                reads.jobs.append(ReadJob(record, tensor_bytes(chunk)))
                reads.partial.append((destination, chunk))
            return
        if self._whole_chunks or shared:
            assert record.shape is not None and record.chunk_offsets is not None
            chunk = torch.empty(record.shape, dtype=_torch_dtype(record))
            reads.jobs.append(ReadJob(record, tensor_bytes(chunk)))
            reads.partial.append((destination, _region(chunk, overlap.lo, overlap.hi,
                                                       origin=record.chunk_offsets)))
            return
        runs, lo, hi = overlap.runs(MAX_GAP_BYTES)
        if destination.device.type == "cpu" and destination.is_contiguous() and (
                (lo, hi) == (overlap.lo, overlap.hi)):
            into = destination
        else:
            into = torch.empty([h - low for low, h in zip(lo, hi, strict=True)],
                               dtype=_torch_dtype(record))
            reads.partial.append((destination, _region(into, overlap.lo, overlap.hi, origin=lo)))
        view, cursor = tensor_bytes(into), 0
        for run in runs:
            reads.jobs.append(ReadJob(run, view[cursor:cursor + run.nbytes]))
            cursor += run.nbytes


class Loads:
    """How an engine's loads are made, for the engine and for the clients of its load (the
    tiers' restore): a `Loader` over any open checkpoint, on the engine's staging pool, copy
    streams and executor."""

    def __init__(self, resources: SaveResources) -> None:
        self._resources = resources

    @property
    def run_blocking(self) -> RunBlocking:
        """The engine's blocking door (file I/O, hashing, CPU work off the loop)."""
        return self._resources.run_blocking

    @property
    def max_files_at_once(self) -> int:
        """How many files of a checkpoint one reader keeps open."""
        return self._resources.config.num_workers

    def loader(self, reader: ItemReader, manifest: Manifest, *, verify: bool,
               whole_chunks: bool = False, share: ReadShare | None = None) -> Loader:
        """A `Loader` of the checkpoint `reader` has open, by `manifest` (see `Loader`)."""
        resources = self._resources
        return Loader(reader, manifest, pool=resources.pool, copy_streams=resources.copy_streams,
                      run_blocking=resources.run_blocking, slab_bytes=resources.config.slab_bytes,
                      verify=verify, whole_chunks=whole_chunks, share=share)


def _place_chunks(partial: Sequence[_Placement]) -> None:
    """Blocks: copy each piece read on its own into its place."""
    for destination, source in partial:
        destination.copy_(source)


def target_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor a rank fills and where it sits in the global tensor: a DTensor's local shard
    and its offsets (resharding), or a plain tensor at the origin."""
    if isinstance(tensor, DTensor):
        (chunk,) = tensor.__create_chunk_list__()
        return tensor.to_local(), tuple(chunk.offsets)
    return tensor, (0,) * tensor.dim()


def _region(tensor: torch.Tensor, lo: Sequence[int], hi: Sequence[int], *,
            origin: Sequence[int]) -> torch.Tensor:
    """The [lo, hi) box (global coordinates) of `tensor`, which starts at `origin`."""
    if tuple(lo) == tuple(origin) and all(
            stop - start == size for start, stop, size in zip(lo, hi, tensor.shape, strict=True)):
        return tensor
    view = tensor
    for dim, (start, stop, at) in enumerate(zip(lo, hi, origin, strict=True)):
        view = view.narrow(dim, start - at, stop - start)
    return view


def rebuild(structure: Structure, items: dict[str, Any], saved: Structure, path: str) -> Any:
    """`structure` (a target's) holding `items` (its values by key) and, for its JSON values,
    the ones the saved structure `saved` holds.

    Raises:
        ValueError: a JSON value of the target that `saved` lacks (naming it and `path`).
    """
    return _rebuild(structure, items, _values_by_key(saved)[0], path)


def _rebuild(structure: Structure, items: dict[str, Any], saved_values: dict[str, Any],
             path: str, prefix: str = "") -> Any:
    """The target state dict's structure with its JSON values replaced by the checkpoint's."""
    (tag, body), = structure.items()
    if tag == "item":
        return items[body]
    if tag == "value":
        if prefix not in saved_values:
            raise ValueError(f"key {prefix!r}: expected a value in checkpoint {path}, "
                             "found none; load() it to see its keys")
        return saved_values[prefix]

    def child(key: Any) -> str:
        return f"{prefix}.{key}" if prefix else str(key)

    if tag == "dict":
        return {k: _rebuild(node, items, saved_values, path, child(k)) for k, node in body}
    nodes = [_rebuild(node, items, saved_values, path, child(i)) for i, node in enumerate(body)]
    return nodes if tag == "list" else tuple(nodes)
