"""Where every item's bytes go: file, offset, and the batches each bin is written in.

A bin file is a byte stream of its items, each starting at a 4 KiB-aligned offset (for mmap
and O_DIRECT), zero padding between. The stream is cut into *batches* of at most
`batch_nbytes`: one batch is staged into one slab and written with one pwritev, so small items
pack together and a huge tensor spans many batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

ALIGN_BYTES = 4096


def align_up(n: int, alignment: int = ALIGN_BYTES) -> int:
    return (n + alignment - 1) // alignment * alignment


def bin_file_name(rank: int, bin_index: int) -> str:
    return f"__{rank}_{bin_index}.distcp"


@dataclass(frozen=True, slots=True)
class Placement:
    """One item's place in its bin file."""

    item_index: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of one item inside one batch: item bytes [item_offset, +nbytes) go to batch
    bytes [batch_offset, +nbytes)."""

    item_index: int
    item_offset: int
    batch_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Batch:
    """File bytes [file_offset, +nbytes) of one bin; padding is every byte no segment covers."""

    file_offset: int
    nbytes: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True, slots=True)
class BinLayout:
    """One bin: its file name, its items' placements (in file order) and its size."""

    file_name: str
    placements: tuple[Placement, ...]
    nbytes: int

    def batches(self, batch_nbytes: int) -> Iterator[Batch]:
        """The file cut into batches of at most `batch_nbytes` (the last is shorter)."""
        if batch_nbytes < ALIGN_BYTES:
            raise ValueError(f"batch_nbytes: expected >= {ALIGN_BYTES}, found {batch_nbytes!r}")
        placements = self.placements
        first = 0  # first placement that may still overlap the next batch
        for start in range(0, self.nbytes, batch_nbytes):
            end = min(start + batch_nbytes, self.nbytes)
            segments = []
            i = first
            while i < len(placements) and placements[i].offset < end:
                p = placements[i]
                lo, hi = max(p.offset, start), min(p.offset + p.nbytes, end)
                if hi > lo:
                    segments.append(Segment(p.item_index, lo - p.offset, lo - start, hi - lo))
                if p.offset + p.nbytes <= end:
                    first = i + 1
                i += 1
            yield Batch(file_offset=start, nbytes=end - start, segments=tuple(segments))


def layout_bin(file_name: str, item_indices: list[int], item_nbytes: list[int]) -> BinLayout:
    """Place items back to back at aligned offsets, in the given order."""
    placements = []
    cursor = 0
    for index in item_indices:
        offset = align_up(cursor)
        placements.append(Placement(index, offset, item_nbytes[index]))
        cursor = offset + item_nbytes[index]
    return BinLayout(file_name=file_name, placements=tuple(placements), nbytes=cursor)
