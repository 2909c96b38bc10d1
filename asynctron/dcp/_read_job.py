"""One rank's `read_data`: DCP's load plan read by asynctron's reader.

Stages (on the runtime's loop; the planner's calls, reads, decodes and copies on the engine's
executor):
1. plan (`_plan`): each read item's stored item found in the checkpoint's manifest; its target
   resolved through the planner. Raw tensor bytes (checkpoints asynctron wrote) of whole rows
   (the item's dim-0 rows range) into a target of the same dtype are read straight into it when
   it is contiguous CPU memory, else (CUDA, strided) filled through the runtime's slabs
   (`SlabFiller`: batched reads into pinned slabs, host-to-device copies on the copy stream
   overlapping the next reads); other raw reads go into a chunk of their own; `torch.save`
   blobs (stock DCP) are read whole, into a buffer of their own;
2. waves (`_waves`): the reads cut, in order, into waves whose buffers (blobs and chunks read
   apart; direct reads need none) total at most `memory_budget_bytes`, and at most 256 MiB; a
   read larger than that makes a wave alone. Each wave borrows its bytes from the runtime's
   budget (shared with the writers' slabs), allocates its buffers, is read, finished, and its
   buffers freed before the next one's are allocated;
3. read: `CheckpointReader.read` (one task per file, batched preadv calls), each whole item
   verified against its digest where the checkpoint has them;
4. finish (`_finish`): blobs decoded without unpickling anything but tensors and plain values,
   chunks narrowed and copied into their targets (dtype conversion, CUDA), then
   `planner.commit_tensor`; pickled values checked the same way before `planner.load_bytes`
   (stock DCP's planner unpickles them with `weights_only=False`).

Memory: beyond the targets, a wave's buffers (at most the budget, or one larger item), and
while an item is finished, its decoded copy; slab fills borrow slabs under the same budget.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from asynctron._memory import tensor_bytes
from asynctron.dcp._runtime import Runtime
from asynctron.engine.lowlevel import SlabFill, SlabFiller
from asynctron.errors import CorruptCheckpointError
from asynctron.storage import ItemRecord, Manifest
from asynctron.storage.backends import CheckpointReader
from asynctron.storage.format import (
    TORCH_DTYPES,
    ReadJob,
    decode_blob,
    saved_value,
    tensor_of,
    value_paths,
)

RecordKey = tuple[str, tuple[int, ...] | None]
"""A stored item: its key and, for a tensor chunk, its offsets in the global tensor."""


@dataclass(frozen=True, slots=True)
class OpenCheckpoint:
    """A checkpoint ready to read: its reader (leased, until `read` closes it), its validated
    manifest, its items by (key, chunk offsets) (a bytes or ndarray item by (key, None): a
    bytes entry to DCP), its structure's JSON values by key (an asynctron-format checkpoint's:
    DCP's planner loads them as bytes entries)."""

    reader: CheckpointReader
    manifest: Manifest
    records: Mapping[RecordKey, ItemRecord]
    values: Mapping[str, Any]

    @property
    def path(self) -> str:
        return self.reader.path

    @classmethod
    def of(cls, reader: CheckpointReader, manifest: Manifest) -> OpenCheckpoint:
        return cls(reader, manifest, {(record.key, record.chunk_offsets if record.kind == "tensor"
                                       else None): record for record in manifest.items},
                   value_paths(manifest.structure, whole_lists=True))


#: The most temporary bytes (blobs, chunks read apart) one wave holds, below
#: `memory_budget_bytes`: a wave is read, then finished, before the next one's are allocated.
_WAVE_BYTES = 256 << 20


@dataclass(slots=True, eq=False)
class _Read:
    """One read item: what is read (`record`: the item, or a range of its rows) and where
    (`buffer`, allocated for its wave: a blob (`blob`) or chunk of `chunk_shape` of its own;
    None when read straight into `target`)."""

    item: ReadItem
    record: ItemRecord
    target: torch.Tensor | None
    starts: tuple[int, ...] = ()
    """Where the wanted region starts in what is read (a blob's whole chunk, or `buffer`)."""
    blob: bool = False
    chunk_shape: tuple[int, ...] | None = None
    buffer: torch.Tensor | None = None
    through_slabs: bool = False
    """Filled through the runtime's slabs (whole rows into a CUDA or strided target)."""

    @property
    def temporary_bytes(self) -> int:
        """The bytes of the buffer this read needs apart from its target."""
        return self.record.nbytes if self.blob or self.chunk_shape is not None else 0


async def read(runtime: Runtime, checkpoint: OpenCheckpoint, plan: LoadPlan,
               planner: LoadPlanner, *, verify: bool) -> None:
    """Read every item of this rank's load plan into the planner's targets; then close the
    checkpoint's reader.

    Raises:
        CorruptCheckpointError: an item missing, truncated, not matching its digest or its
            metadata (naming file and key); its subclass `RefusedObjectError` (also a
            `TypeError`), a blob holding globals asynctron does not unpickle (naming them and
            `torch.serialization.add_safe_globals`).
        ValueError: a target whose shape differs from the read item's (naming the key).
        StorageError: a read failed.

    Cancellation: reads in flight finish; targets may be partly filled.
    """
    run_blocking = runtime.run_blocking
    reader = checkpoint.reader
    try:
        reads, values = await run_blocking(_plan, checkpoint, plan, planner)
        if values:
            await run_blocking(_load_values, values, planner)
        filled = [read_ for read_ in reads if read_.through_slabs]
        if filled:
            filler = SlabFiller(reader, pool=runtime.pool, copy_streams=runtime.copy_streams,
                                run_blocking=run_blocking, verify=verify)
            await filler.fill([SlabFill(read_.record, read_.target) for read_ in filled
                               if read_.target is not None])
            await run_blocking(_commit, filled, planner)
        budget = runtime.pool.budget  # shared with the writers' slabs
        limit = min(budget.total_bytes, _WAVE_BYTES)
        for wave, nbytes in _waves([read_ for read_ in reads if not read_.through_slabs],
                                   limit):
            await budget.acquire(nbytes)  # a read larger than the budget: alone
            try:
                # In a box emptied here: the executor's futures sit in reference cycles,
                # which would keep the buffers until the next garbage collection.
                jobs = (await run_blocking(_allocate, wave)).pop()
                errors = await reader.read(jobs, verify=verify,
                                           slab_bytes=runtime.config.slab_bytes)
                del jobs
                if errors:
                    raise errors[0]
                await run_blocking(_finish, wave, planner, reader.file_path)
            finally:
                for read_ in wave:
                    read_.buffer = None
                budget.release(nbytes)
    finally:
        await reader.aclose()


def _waves(reads: Sequence[_Read], limit: int) -> list[tuple[list[_Read], int]]:
    """`reads` in order, cut into waves of at most `limit` temporary bytes (a larger read in a
    wave of its own); each with its temporary bytes."""
    waves: list[tuple[list[_Read], int]] = []
    wave: list[_Read] = []
    nbytes = 0
    for read_ in reads:
        size = read_.temporary_bytes
        if wave and nbytes + size > limit:
            waves.append((wave, nbytes))
            wave, nbytes = [], 0
        wave.append(read_)
        nbytes += size
    if wave:
        waves.append((wave, nbytes))
    return waves


def _temporary(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Blocks: a buffer for one wave's read."""
    return torch.empty(shape, dtype=dtype)


def _allocate(wave: Sequence[_Read]) -> list[list[ReadJob]]:
    """Blocks: the wave's buffers, and its reads (in a one-item list)."""
    jobs: list[ReadJob] = []
    for read_ in wave:
        if read_.blob:
            read_.buffer = _temporary((read_.record.nbytes,), torch.uint8)
        elif read_.chunk_shape is not None:
            assert read_.record.dtype is not None
            read_.buffer = _temporary(read_.chunk_shape, TORCH_DTYPES[read_.record.dtype])
        if read_.record.nbytes:
            destination = read_.target if read_.buffer is None else read_.buffer
            assert destination is not None
            jobs.append(ReadJob(read_.record, tensor_bytes(destination)))
    return [jobs]


def _plan(checkpoint: OpenCheckpoint, plan: LoadPlan, planner: LoadPlanner
          ) -> tuple[list[_Read], list[tuple[ReadItem, Any]]]:
    """Blocks: each read item's stored item, target and read (its buffer not allocated); and
    the read items that are the structure's JSON values, with their values."""
    reads: list[_Read] = []
    values: list[tuple[ReadItem, Any]] = []
    for item in plan.items:
        index = item.storage_index
        key = index.fqn
        offsets = None if index.offset is None else tuple(index.offset)
        record = checkpoint.records.get((key, offsets))
        if record is None and item.type == LoadItemType.BYTE_IO and key in checkpoint.values:
            values.append((item, checkpoint.values[key]))
            continue
        if record is None:
            where = "" if offsets is None else f" chunk at {list(offsets)}"
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint.path}: expected item {key!r}{where}, which DCP's "
                "metadata lists, in its manifest; found none; the checkpoint is damaged",
                path=checkpoint.path, key=key)
        if item.type == LoadItemType.BYTE_IO or record.encoding == "torch_save":
            target = None
            if item.type != LoadItemType.BYTE_IO:
                target = _target(planner, item, record, checkpoint.path)
            reads.append(_Read(item, record, target, tuple(item.storage_offsets), blob=True))
            continue
        target = _target(planner, item, record, checkpoint.path)
        reads.append(_raw_read(item, record, target))
    return reads, values


def _load_values(values: Sequence[tuple[ReadItem, Any]], planner: LoadPlanner) -> None:
    """Blocks: hand DCP's planner each JSON value as the `torch.save`d bytes it loads."""
    for item, value in values:
        planner.load_bytes(item, io.BytesIO(saved_value(value)))


def _target(planner: LoadPlanner, item: ReadItem, record: ItemRecord, path: str
            ) -> torch.Tensor:
    target = planner.resolve_tensor(item).detach()
    if tuple(target.shape) != tuple(item.lengths):
        raise ValueError(f"load target for {item.dest_index.fqn!r}: expected shape "
                         f"{list(item.lengths)} (of item {record.key!r} in {path}), found "
                         f"{list(target.shape)}; the planner resolved a tensor of another shape")
    return target


def _raw_read(item: ReadItem, record: ItemRecord, target: torch.Tensor) -> _Read:
    """The read of a raw tensor chunk's wanted region: the range of its rows that holds it (the
    whole item, verifiable, when all rows are wanted), straight into `target` when the region
    is those whole rows and `target` is contiguous CPU memory of the item's dtype."""
    assert record.dtype is not None and record.shape is not None
    dtype = TORCH_DTYPES[record.dtype]
    shape, starts, lengths = record.shape, tuple(item.storage_offsets), tuple(item.lengths)
    if not shape:
        part, rows_shape, starts_in_part = record, shape, starts
    else:
        first, count = starts[0], lengths[0]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        rows_shape = (count, *shape[1:])
        part = record if (first, count) == (0, shape[0]) else dataclasses.replace(
            record, offset=record.offset + first * row_bytes, nbytes=count * row_bytes,
            shape=rows_shape, checksum=None)
        starts_in_part = (0, *starts[1:])
    if tuple(lengths) != tuple(rows_shape) or target.dtype != dtype:
        return _Read(item, part, target, starts_in_part, chunk_shape=tuple(rows_shape))
    direct = target.device.type == "cpu" and target.is_contiguous()
    return _Read(item, part, target, starts_in_part, through_slabs=not direct)


def _region(tensor: torch.Tensor, starts: Sequence[int], lengths: Sequence[int]
            ) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _commit(reads: Sequence[_Read], planner: LoadPlanner) -> None:
    """Blocks: hand every filled target to the planner."""
    for read_ in reads:
        assert read_.target is not None
        planner.commit_tensor(read_.item, read_.target)


def _finish(reads: Sequence[_Read], planner: LoadPlanner,
            file_path: Callable[[ItemRecord], str]) -> None:
    """Blocks: decode blobs, place chunks read apart, hand every item to the planner."""
    for read in reads:
        record, item = read.record, read.item
        if read.blob and record.encoding == "raw":  # asynctron's bytes or ndarray item
            assert read.buffer is not None
            planner.load_bytes(item, io.BytesIO(saved_value(_raw_value(record, read.buffer))))
            continue
        if read.blob:
            assert read.buffer is not None
            file = file_path(record)
            data = tensor_bytes(read.buffer)
            value = decode_blob(data, key=record.key, path=file)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(data))
                continue
            source = _region(tensor_of(value, record, file), read.starts, item.lengths)
        elif read.buffer is not None:
            source = _region(read.buffer, read.starts, item.lengths)
        else:
            source = None
        assert read.target is not None
        if source is not None:
            read.target.copy_(source)
        planner.commit_tensor(item, read.target)


def _raw_value(record: ItemRecord, buffer: torch.Tensor) -> Any:
    """The value of a raw bytes or ndarray item read into `buffer`."""
    if record.kind == "bytes":
        return bytes(tensor_bytes(buffer))
    assert record.dtype is not None and record.shape is not None
    return np.frombuffer(tensor_bytes(buffer), dtype=np.dtype(record.dtype)).reshape(
        record.shape).copy()
