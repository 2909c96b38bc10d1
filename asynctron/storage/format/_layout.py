"""Where every item's bytes go in its bin file, and the batches a bin is staged and written in.

A bin file is a stream of *pieces*: each item's bytes (its *body*) and, in DCP's format, the
`torch.save` frame bytes just before and after a tensor's body (its *head* and *tail*). An
item starts at a 4 KiB-aligned offset when it holds at least a page (mmap and O_DIRECT want
pages), at a 64-byte-aligned one when it is smaller (so a state of many tiny tensors packs
densely, as `torch.save` packs it); zero bytes fill the gaps.

The stream is cut into *batches* at fixed multiples of `slab_bytes`: one batch is staged into
one slab and written with one pwritev. A *segment* is the part of one piece inside one batch.

Pieces, segments and gaps are numpy arrays, one entry each: a plan of 100k items is laid out,
cut and staged without a Python step per item.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

ALIGN_BYTES = 4096
SMALL_ALIGN_BYTES = 64
"""Alignment of items smaller than `ALIGN_BYTES` (a cache line, and any dtype's itemsize)."""


class Part(enum.IntEnum):
    """Which bytes of an item a piece holds."""

    HEAD = 0
    BODY = 1
    TAIL = 2


def align_up(n: int, alignment: int = ALIGN_BYTES) -> int:
    return (n + alignment - 1) // alignment * alignment


def bin_file_name(rank: int, bin_index: int) -> str:
    return f"__{rank}_{bin_index}.distcp"


@dataclass(frozen=True, slots=True, eq=False)
class BinLayout:
    """One bin file: its pieces in file order (per piece: its item, part, offset and size)
    and the file's size."""

    file_name: str
    item: np.ndarray
    """int64 per piece: the item (index in the plan) the piece belongs to."""
    part: np.ndarray
    """int8 per piece: a `Part`."""
    offset: np.ndarray
    """int64 per piece: where it starts in the file."""
    size: np.ndarray
    """int64 per piece: its bytes."""
    nbytes: int
    """The file's size: the end of its last piece."""

    def body_offsets(self) -> dict[int, int]:
        """Each item's body offset in the file, by item index."""
        bodies = self.part == Part.BODY
        return dict(zip(self.item[bodies].tolist(), self.offset[bodies].tolist(), strict=True))

    def batches(self, slab_bytes: int) -> Batches:
        """The file cut into batches of at most `slab_bytes` (the last is shorter)."""
        if slab_bytes < ALIGN_BYTES:
            raise ValueError(f"slab_bytes: expected >= {ALIGN_BYTES}, found {slab_bytes!r}")
        return Batches.cut(self, slab_bytes)


def layout_bin(file_name: str, item_indices: list[int], pieces: list[tuple[int, ...]]
               ) -> BinLayout:
    """Place items in the given order, each item's pieces back to back from an aligned offset.

    Args:
        item_indices: the items of this bin, in file order.
        pieces: per item (by index), its piece sizes: `(body,)` or `(head, body, tail)`.
    """
    items: list[int] = []
    parts: list[int] = []
    offsets: list[int] = []
    sizes: list[int] = []
    cursor = 0
    for index in item_indices:
        item_pieces = pieces[index]
        total = sum(item_pieces)
        if total:
            cursor = align_up(cursor, ALIGN_BYTES if total >= ALIGN_BYTES else SMALL_ALIGN_BYTES)
        for part, size in zip(_PARTS[len(item_pieces)], item_pieces, strict=True):
            items.append(index)
            parts.append(part)
            offsets.append(cursor)
            sizes.append(size)
            cursor += size
    return BinLayout(file_name=file_name, item=np.array(items, dtype=np.int64),
                     part=np.array(parts, dtype=np.int8),
                     offset=np.array(offsets, dtype=np.int64),
                     size=np.array(sizes, dtype=np.int64), nbytes=cursor)


_PARTS = {1: (Part.BODY,), 3: (Part.HEAD, Part.BODY, Part.TAIL)}


@dataclass(frozen=True, slots=True, eq=False)
class Batches:
    """A bin file cut into batches: every segment and every gap (bytes no piece covers), in
    file order, grouped by batch. Batch `i` is file bytes [i·slab_bytes, +`batch_bytes(i)`);
    its segments are `[segment_starts[i], segment_starts[i+1])`, its gaps likewise."""

    slab_bytes: int
    file_bytes: int
    piece: np.ndarray
    """int64 per segment: the piece (index in the layout) it is part of."""
    piece_offset: np.ndarray
    """int64 per segment: where it starts inside its piece."""
    batch_offset: np.ndarray
    """int64 per segment: where it starts inside its batch."""
    size: np.ndarray
    """int64 per segment: its bytes."""
    segment_starts: np.ndarray
    gap_offset: np.ndarray
    """int64 per gap: where it starts inside its batch."""
    gap_size: np.ndarray
    gap_starts: np.ndarray

    def __len__(self) -> int:
        return len(self.segment_starts) - 1

    def file_offset(self, index: int) -> int:
        return index * self.slab_bytes

    def batch_bytes(self, index: int) -> int:
        return min(self.slab_bytes, self.file_bytes - index * self.slab_bytes)

    def segments(self, index: int) -> slice:
        return slice(int(self.segment_starts[index]), int(self.segment_starts[index + 1]))

    def gaps(self, index: int) -> slice:
        return slice(int(self.gap_starts[index]), int(self.gap_starts[index + 1]))

    @classmethod
    def cut(cls, layout: BinLayout, slab_bytes: int) -> Batches:
        num_batches = -(-layout.nbytes // slab_bytes)
        present = np.flatnonzero(layout.size > 0)
        start = layout.offset[present]
        stop = start + layout.size[present]
        first = start // slab_bytes
        count = (stop - 1) // slab_bytes - first + 1
        piece = np.repeat(present, count)
        # the k-th segment of a piece lies in batch first + k
        k = np.arange(len(piece)) - np.repeat(np.cumsum(count) - count, count)
        batch = np.repeat(first, count) + k
        lo = np.maximum(np.repeat(start, count), batch * slab_bytes)
        hi = np.minimum(np.repeat(stop, count), (batch + 1) * slab_bytes)
        segment_starts = np.searchsorted(batch, np.arange(num_batches + 1))
        # gaps: before each segment (from the previous segment's end in its batch, or the
        # batch's start), and after the last segment of each batch up to the batch's end
        batch_start = batch * slab_bytes
        previous_end = np.where(np.arange(len(batch)) == segment_starts[batch], batch_start,
                                np.concatenate(([0], hi[:-1])))
        batch_end = np.minimum((np.arange(num_batches) + 1) * slab_bytes, layout.nbytes)
        last_end = np.where(segment_starts[1:] > segment_starts[:-1],
                            hi[np.maximum(segment_starts[1:] - 1, 0)] if len(hi) else 0,
                            np.arange(num_batches) * slab_bytes)
        gap_batch = np.concatenate((batch, np.arange(num_batches)))
        gap_lo = np.concatenate((previous_end, last_end))
        gap_hi = np.concatenate((lo, batch_end))
        # order: by batch, then by position (a batch's trailing gap sorts after its segments)
        order = np.lexsort((gap_lo, gap_batch))
        keep = order[gap_hi[order] > gap_lo[order]]
        gap_batch = gap_batch[keep]
        return cls(slab_bytes=slab_bytes, file_bytes=layout.nbytes, piece=piece,
                   piece_offset=lo - np.repeat(start, count), batch_offset=lo - batch_start,
                   size=hi - lo, segment_starts=segment_starts,
                   gap_offset=gap_lo[keep] - gap_batch * slab_bytes,
                   gap_size=gap_hi[keep] - gap_lo[keep],
                   gap_starts=np.searchsorted(gap_batch, np.arange(num_batches + 1)))
