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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

#: Chunks are never cut smaller than this: below it, parallel files buy nothing.
MIN_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class PlannedItem:
    """One item to write: all of a DCP write item's payload, or rows [start, stop) of its
    dim 0 (`rows`)."""

    write_item: WriteItem
    nbytes: int
    rows: tuple[int, int] | None = None

    @property
    def type(self) -> WriteItemType:
        return self.write_item.type

    @property
    def key(self) -> str:
        return self.write_item.index.fqn

    def chunk(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(shape, offsets) of this item's chunk within the global tensor."""
        data = self.write_item.tensor_data
        assert data is not None, "bytes items have no chunk"
        sizes, offsets = list(data.chunk.sizes), list(data.chunk.offsets)
        if self.rows is not None:
            start, stop = self.rows
            sizes[0] = stop - start
            offsets[0] += start
        return tuple(sizes), tuple(offsets)


def chunk_large_items(items: Sequence[WriteItem], nbytes: Sequence[int],
                      num_bins: int) -> list[PlannedItem]:
    """`items` (with their sizes) as planned items, large tensors cut into dim-0 chunks.

    Deterministic: the same items, sizes and `num_bins` give the same chunks.
    """
    tensor_nbytes = sum(n for item, n in zip(items, nbytes, strict=True)
                        if item.type != WriteItemType.BYTE_IO)
    share = max(MIN_CHUNK_BYTES, -(-tensor_nbytes // num_bins))
    planned: list[PlannedItem] = []
    for item, size in zip(items, nbytes, strict=True):
        rows = item.tensor_data.chunk.sizes[0] if (
            item.tensor_data is not None and item.tensor_data.chunk.sizes) else 0
        if item.type == WriteItemType.BYTE_IO or size <= share or rows < 2:
            planned.append(PlannedItem(item, size))
            continue
        num_chunks = min(rows, -(-size // share))
        row_nbytes = size // rows
        bounds = [rows * k // num_chunks for k in range(num_chunks + 1)]
        planned.extend(PlannedItem(item, (stop - start) * row_nbytes, (start, stop))
                       for start, stop in itertools.pairwise(bounds))
    return planned
