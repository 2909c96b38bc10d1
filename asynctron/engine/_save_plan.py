"""Planning one save on this rank: a flat state dict becomes a `SaveRequest`, everything
decided before any byte moves.

Stages (blocking and CPU-bound; the engine runs them on its executor so that a state dict of
thousands of tensors never stalls the event loop):
1. DCP's `DefaultSavePlanner` turns the leaves into write items, globally deduplicated across
   ranks by the coordinator (`storage.format`, `_coordinator.exchange_plans`);
2. `file_plan`: tensors larger than their fair share of the bins are cut into dim-0 chunks
   (`storage._chunking`), Megatron's splitter deals the items onto bins (`storage._split`),
   each bin file is laid out (aligned items) and cut into batches (`storage.format`).
Steps 1-2 depend only on the structure of every rank's state dict, so an unchanged structure
takes them from the `PlanCache` (seed 002). Per save remain (`build_request`) where each
item's bytes are (their addresses, vectorised per bin) and fresh checksums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from asynctron.engine._plan_cache import FilePlan, structure_signature
from asynctron.engine._report import WriteReport
from asynctron.engine._staging import BinSources, Sources, piece_addresses
from asynctron.storage import ItemRecord, split_by_size_and_type
from asynctron.storage.format import (
    BinLayout,
    Checksums,
    FlatStateDict,
    Part,
    PlainPlan,
    PlannedItem,
    SavePlan,
    bin_file_name,
    chunk_large_items,
    digest,
    dtype_name,
    layout_bin,
    torch_save_frame,
)


@dataclass(frozen=True, slots=True, eq=False)
class SaveRequest:
    """A planned save on this rank. Not constructed directly; `build_request` makes one."""

    structure: str
    """The state dict's nesting and JSON values, as JSON text (the manifest's)."""
    plan: FilePlan
    bins: tuple[BinSources, ...]
    """Per bin: its layout and batches, and where each of its pieces' bytes are."""
    checksums: Checksums | None
    """The items' digests, filled as they are written; None when the engine saves without
    checksums."""

    @property
    def nbytes(self) -> int:
        return sum(record.nbytes for record in self.plan.records)

    def report(self, rank: int) -> WriteReport:
        """This rank's write report, once every item has been written (its digest is final)."""
        checksums = None if self.checksums is None else tuple(self.checksums.hexdigests())
        return WriteReport(rank=rank, records=self.plan.records, checksums=checksums,
                           structure=self.structure,
                           files={layout.file_name: layout.nbytes
                                  for layout in self.plan.layouts},
                           frames=tuple((len(frame[0]), len(frame[1])) if frame else None
                                        for frame in self.plan.frames))


def structure_digest(flat: FlatStateDict, *, num_bins: int, rank: int,
                     slab_bytes: int) -> str | None:
    """Blocks: a digest of everything this rank's file plan depends on; None when the plan must
    be made fresh each time (DTensor and other tensor subclasses)."""
    signature = structure_signature(flat, num_bins=num_bins, rank=rank, slab_bytes=slab_bytes)
    return None if signature is None else digest(memoryview(signature.encode()))


def file_plan(flat: FlatStateDict, items: Sequence[PlannedItem], *, num_bins: int, rank: int,
              slab_bytes: int, torch_save_frames: bool) -> tuple[FilePlan, tuple[int, ...]]:
    """Blocks (CPU-bound): this rank's items (from DCP's planner, the plain plan or a
    placement) cut into chunks, split onto bins (seed 000) group by group (group g's bins are
    numbered from `g * num_bins`: `file_group` tells a file's), laid out and cut into batches
    of `slab_bytes`; and per item of the plan, its source (the index of its payload among
    `items`' sources). With `torch_save_frames` (DCP's format) every tensor item is laid out
    inside its `torch.save` frame: prefix, raw bytes, suffix."""
    items = chunk_large_items(items, num_bins)
    frames = tuple(_frame(item) if torch_save_frames else None for item in items)
    index_of = {id(item): i for i, item in enumerate(items)}
    pieces = [(len(frame[0]), item.nbytes, len(frame[1])) if frame else (item.nbytes,)
              for item, frame in zip(items, frames, strict=True)]
    layouts = tuple(
        layout_bin(bin_file_name(rank, group * num_bins + b),
                   [index_of[id(item)] for item in bin_items], pieces)
        for group in sorted({item.group for item in items})
        for b, bin_items in enumerate(split_by_size_and_type(
            num_bins, [item for item in items if item.group == group], lambda item: item.nbytes))
        if bin_items
    )
    placed = {item: (layout.file_name, offset)
              for layout in layouts for item, offset in layout.body_offsets().items()}
    records = tuple(_record(flat, item, *placed[i]) for i, item in enumerate(items))
    return FilePlan(keys=tuple(item.key for item in items),
                    rows=tuple(item.rows for item in items), records=records,
                    layouts=layouts,
                    batches=tuple(layout.batches(slab_bytes) for layout in layouts),
                    frame_addresses=tuple(_frame_addresses(layout, frames)
                                          for layout in layouts),
                    frames=frames), tuple(item.source for item in items)


def file_group(name: str, num_bins: int) -> int:
    """The group whose items the bin file `name` (`__<rank>_<bin>.distcp`) holds."""
    return int(name.rsplit("_", 1)[1].split(".", 1)[0]) // num_bins


def dcp_items(save_plan: SavePlan) -> list[PlannedItem]:
    """This rank's share of DCP's plan as planned items (source: the write item's index)."""
    return [PlannedItem.of_write_item(i, item, save_plan.nbytes(item))
            for i, item in enumerate(save_plan.items)]


def plain_items(flat: FlatStateDict, plan: PlainPlan, mine: Sequence[bool]) -> list[PlannedItem]:
    """The plain items this rank writes (`mine`, per key of its plain plan; a key several
    ranks hold is written by one of them), planned without DCP's planner."""
    values = flat.values
    return [PlannedItem.of_value(i, key, values[key])
            for i, (key, write) in enumerate(zip(plan.keys, mine, strict=True)) if write]


def _frame_addresses(layout: BinLayout, frames: tuple[tuple[bytes, bytes] | None, ...]
                     ) -> np.ndarray:
    """uint64 per piece: the address of a frame piece's bytes (held by `frames`), 0 for
    bodies (and for empty frame pieces)."""
    addresses = np.zeros(len(layout.item), dtype=np.uint64)
    for piece in np.flatnonzero((layout.part != Part.BODY) & (layout.size > 0)).tolist():
        frame = frames[int(layout.item[piece])]
        assert frame is not None
        data = frame[0] if layout.part[piece] == Part.HEAD else frame[1]
        addresses[piece] = np.frombuffer(data, dtype=np.uint8).ctypes.data
    return addresses


def _frame(item: PlannedItem) -> tuple[bytes, bytes] | None:
    """The `torch.save` frame of a tensor item's chunk (None for pickled objects: their bytes
    are already a `torch.save` blob)."""
    if item.type == WriteItemType.BYTE_IO:
        return None
    assert item.dtype is not None
    return torch_save_frame(item.chunk()[0], item.dtype)


def build_request(flat: FlatStateDict, plan: FilePlan,
                  dcp: tuple[SavePlan, Sequence[WriteItem]] | None, *,
                  checksum: bool) -> SaveRequest:
    """Blocks: the per-save part of a request: where each item's bytes come from (a plan made
    by DCP's planner resolves each item's write item, DTensor shards too; otherwise the plain
    tensors are taken by key), per bin every piece's address, fresh checksums."""
    if dcp is not None:
        save_plan, write_items = dcp
        payloads = [save_plan.payload(item) for item in write_items]
    else:
        values = flat.values
        payloads = [_local(values[key]) for key in plan.keys]
    sources = Sources([_rows(payload, rows)
                       for payload, rows in zip(payloads, plan.rows, strict=True)])
    bins = tuple(BinSources(layout, batches, piece_addresses(layout, sources, frames), sources)
                 for layout, batches, frames in zip(plan.layouts, plan.batches,
                                                    plan.frame_addresses, strict=True))
    checksums = Checksums(len(plan.records)) if checksum else None
    return SaveRequest(structure=flat.structure_json, plan=plan, bins=bins,
                       checksums=checksums)


def _local(value: torch.Tensor | bytes) -> torch.Tensor | bytes:
    """The bytes a value's item holds: a DTensor's local chunk, else the value itself."""
    return value.to_local().detach() if isinstance(value, DTensor) else value


def _rows(payload: torch.Tensor | bytes, rows: tuple[int, int] | None) -> torch.Tensor | bytes:
    if rows is None:
        return payload
    assert isinstance(payload, torch.Tensor)
    return payload.narrow(0, rows[0], rows[1] - rows[0])


def _record(flat: FlatStateDict, item: PlannedItem, file: str, offset: int) -> ItemRecord:
    key = item.key
    kind = flat.kinds[key]
    if item.type == WriteItemType.BYTE_IO:
        if kind == "object":
            return ItemRecord(key=key, kind="object", file=file, offset=offset,
                              nbytes=item.nbytes, checksum=None, encoding="torch_save")
        return ItemRecord(key=key, kind="bytes", file=file, offset=offset, nbytes=item.nbytes,
                          checksum=None)
    assert item.dtype is not None
    dtype = flat.arrays[key][0] if kind == "ndarray" else dtype_name(item.dtype, key)
    shape, offsets = item.chunk()
    return ItemRecord(key=key, kind=kind, file=file, offset=offset, nbytes=item.nbytes,
                      checksum=None, dtype=dtype, shape=shape, global_shape=item.global_shape,
                      chunk_offsets=offsets)
