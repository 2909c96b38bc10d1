"""Cutting large tensor items into dim-0 chunks, so that one huge tensor spreads over several
bins (files, writer tasks) and is written, and later read, in parallel.

Megatron's splitter deals whole items onto bins, so a state dict dominated by one tensor (an
embedding, a fused weight) lands in one file written by one thread. Here, before the split, a
tensor item larger than its fair share of the bins (all tensor bytes / `num_bins`, and never
less than `MIN_CHUNK_BYTES`) is cut along dim 0 into that many near-equal row ranges. Each
chunk is an item of its own with DCP chunk metadata (global shape, offsets): exactly what the
shards of a sharded tensor are, so every reader of sharded checkpoints reads it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

#: Chunks are never cut smaller than this: below it, parallel files buy nothing.
MIN_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class PlannedItem:
    """One item to write: all of payload `source` (its index in the plan), or rows
    [start, stop) of its dim 0 (`rows`). A tensor payload is a chunk of a global tensor: its
    `shape` at `offsets` in `global_shape` (a plain tensor is the whole of itself). Items of
    one `group` share bin files no other group's items are in (a tier's: which copies a file
    goes to)."""

    key: str
    source: int
    type: WriteItemType
    nbytes: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None
    global_shape: tuple[int, ...] | None = None
    rows: tuple[int, int] | None = None
    group: int = 0

    @classmethod
    def of_write_item(cls, source: int, item: WriteItem, nbytes: int) -> PlannedItem:
        """A DCP write item (a DTensor shard, a tensor, bytes or a pickled value)."""
        data = item.tensor_data
        if data is None:
            return cls(item.index.fqn, source, item.type, nbytes)
        return cls(item.index.fqn, source, item.type, nbytes, data.properties.dtype,
                   tuple(data.chunk.sizes), tuple(data.chunk.offsets), tuple(data.size))

    @classmethod
    def of_value(cls, source: int, key: str, value: torch.Tensor | bytes, *,
                 group: int = 0) -> PlannedItem:
        """A plain tensor (whole), a DTensor's local chunk, or a bytes value, planned without
        DCP's planner."""
        if isinstance(value, bytes):
            return cls(key, source, WriteItemType.BYTE_IO, len(value), group=group)
        if isinstance(value, DTensor):
            (chunk,) = value.__create_chunk_list__()
            shape = tuple(chunk.sizes)
            return cls(key, source, WriteItemType.SHARD, math.prod(shape) * value.dtype.itemsize,
                       value.dtype, shape, tuple(chunk.offsets), tuple(value.shape),
                       group=group)
        shape = tuple(value.shape)
        return cls(key, source, WriteItemType.TENSOR, value.numel() * value.dtype.itemsize,
                   value.dtype, shape, (0,) * len(shape), shape, group=group)

    def chunk(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(shape, offsets) of this item's chunk within the global tensor."""
        assert self.shape is not None and self.offsets is not None, "bytes items have no chunk"
        if self.rows is None:
            return self.shape, self.offsets
        start, stop = self.rows
        return (stop - start, *self.shape[1:]), (self.offsets[0] + start, *self.offsets[1:])


def chunk_large_items(items: Sequence[PlannedItem], num_bins: int) -> list[PlannedItem]:
    """`items`, large tensors cut into dim-0 chunks.

    Deterministic: the same items and `num_bins` give the same chunks.
    """
    tensor_bytes = sum(item.nbytes for item in items if item.type != WriteItemType.BYTE_IO)
    share = max(MIN_CHUNK_BYTES, -(-tensor_bytes // num_bins))
    planned: list[PlannedItem] = []
    for item in items:
        rows = item.shape[0] if item.shape else 0
        if item.type == WriteItemType.BYTE_IO or item.nbytes <= share or rows < 2:
            planned.append(item)
            continue
        num_chunks = min(rows, -(-item.nbytes // share))
        row_bytes = item.nbytes // rows
        bounds = [rows * k // num_chunks for k in range(num_chunks + 1)]
        planned.extend(dataclasses.replace(item, nbytes=(stop - start) * row_bytes,
                                           rows=(start, stop))
                       for start, stop in itertools.pairwise(bounds))
    return planned
