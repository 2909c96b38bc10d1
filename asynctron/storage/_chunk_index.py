"""`ChunkIndex`: which saved chunks of one tensor overlap a wanted box, without scanning all.

Resharding on load asks, for each shard a rank wants (a box of the global tensor), which saved
chunks overlap it. DCP's default load planner compares every wanted chunk with every saved
one: O(wanted × saved) per tensor, which hurts at thousands of ranks. Here, per dimension, the
chunks are sorted by start; a query bisects each dimension for the chunks that can reach the
box (start in (lo - longest chunk, hi)), and intersects the dimensions' answers, starting with
the smallest. For the grid tilings sharding produces, that is O(log n + k) per dimension.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from asynctron.storage._manifest import ItemRecord


@dataclass(frozen=True, slots=True)
class Overlap:
    """Where a saved chunk and a wanted box meet, in global coordinates: [lo, hi) per dim."""

    record: ItemRecord
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @property
    def covers_record(self) -> bool:
        """Whether the whole saved chunk lies in the box."""
        assert self.record.chunk_offsets is not None and self.record.shape is not None
        return self.lo == self.record.chunk_offsets and self.hi == tuple(
            o + s for o, s in zip(self.record.chunk_offsets, self.record.shape, strict=True))


class ChunkIndex:
    """The saved chunks (records) of one tensor key, indexed per dimension."""

    def __init__(self, records: Sequence[ItemRecord]) -> None:
        self._records = list(records)
        first = self._records[0]
        assert first.shape is not None
        self._ndim = len(first.shape)
        self._starts: list[list[int]] = []
        self._order: list[list[int]] = []
        self._longest: list[int] = []
        for dim in range(self._ndim):
            order = sorted(range(len(self._records)),
                           key=lambda i: self._offsets(i)[dim])
            self._order.append(order)
            self._starts.append([self._offsets(i)[dim] for i in order])
            self._longest.append(max(self._shape(i)[dim] for i in order))

    def _offsets(self, index: int) -> tuple[int, ...]:
        offsets = self._records[index].chunk_offsets
        assert offsets is not None
        return offsets

    def _shape(self, index: int) -> tuple[int, ...]:
        shape = self._records[index].shape
        assert shape is not None
        return shape

    def overlapping(self, offsets: Sequence[int], shape: Sequence[int]) -> list[Overlap]:
        """The saved chunks that overlap the box at `offsets` of `shape`, in file order."""
        if self._ndim == 0:
            return [Overlap(record, (), ()) for record in self._records]
        candidates: set[int] | None = None
        for dim in sorted(range(self._ndim), key=lambda d: shape[d]):
            lo, hi = offsets[dim], offsets[dim] + shape[dim]
            starts = self._starts[dim]
            first = bisect.bisect_right(starts, lo - self._longest[dim])
            last = bisect.bisect_left(starts, hi)
            found = {i for i in self._order[dim][first:last]
                     if self._offsets(i)[dim] + self._shape(i)[dim] > lo}
            candidates = found if candidates is None else candidates & found
            if not candidates:
                return []
        assert candidates is not None
        overlaps = []
        for index in sorted(candidates, key=lambda i: (self._records[i].file,
                                                       self._records[i].offset)):
            record_lo, record_shape = self._offsets(index), self._shape(index)
            lo = tuple(max(o, r) for o, r in zip(offsets, record_lo, strict=True))
            hi = tuple(min(o + s, r + n) for o, s, r, n in zip(offsets, shape, record_lo,
                                                              record_shape, strict=True))
            if all(h > low for h, low in zip(hi, lo, strict=True)):
                overlaps.append(Overlap(self._records[index], lo, hi))
        return overlaps
