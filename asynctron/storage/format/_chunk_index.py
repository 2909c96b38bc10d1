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
import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from asynctron.storage.format._manifest import ItemRecord

#: At most this many separate runs are read of one saved chunk; with more, whole rows are.
MAX_RUNS_PER_CHUNK = 1 << 12


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

    def runs(self, min_gap_bytes: int) -> tuple[list[ItemRecord], tuple[int, ...],
                                                 tuple[int, ...]]:
        """What to read of the saved chunk: its runs (contiguous in the file, in file order;
        records of their own whose checksum is None, as a digest covers whole items only) and
        the box [lo, hi) they hold, in global coordinates, as its bytes in row-major order.

        The box is the overlap itself (a column shard's part of each row, say) unless its runs
        are more than `MAX_RUNS_PER_CHUNK` or closer than `min_gap_bytes` (reading between them
        costs no more than skipping); then it widens to the whole inner dimensions, down to
        one run of whole rows.
        """
        shape, origin = self.record.shape, self.record.chunk_offsets
        assert shape is not None and origin is not None
        lo = [low - at for low, at in zip(self.lo, origin, strict=True)]
        hi = [high - at for high, at in zip(self.hi, origin, strict=True)]
        strides = [math.prod(shape[dim + 1:]) * self.record.nbytes // math.prod(shape)
                   for dim in range(len(shape))]

        def gap_bytes(dim: int) -> int:  # between two runs cut at `dim`
            return (shape[dim] - (hi[dim] - lo[dim])) * strides[dim]

        def num_runs(dim: int) -> int:
            return math.prod(hi[outer] - lo[outer] for outer in range(dim))

        # `level`: the dimension runs are cut at, the innermost the box does not span whole
        level = len(shape) - 1
        while level > 0 and lo[level] == 0 and hi[level] == shape[level]:
            level -= 1
        while level > 0 and (gap_bytes(level) < min_gap_bytes
                             or num_runs(level) > MAX_RUNS_PER_CHUNK):
            level -= 1
        run_shape = (1,) * level + (hi[level] - lo[level], *shape[level + 1:])
        runs = []
        for index in itertools.product(*(range(lo[dim], hi[dim]) for dim in range(level))):
            start = (*index, lo[level], *(0,) * (len(shape) - level - 1))
            runs.append(dataclasses.replace(
                self.record, shape=run_shape,
                chunk_offsets=tuple(at + s for at, s in zip(origin, start, strict=True)),
                offset=self.record.offset + sum(
                    s * stride for s, stride in zip(start, strides, strict=True)),
                nbytes=(hi[level] - lo[level]) * strides[level], checksum=None))
        box_lo = (*self.lo[:level + 1], *origin[level + 1:])
        box_hi = (*self.hi[:level + 1], *(at + n for at, n in zip(
            origin[level + 1:], shape[level + 1:], strict=True)))
        return runs, box_lo, box_hi


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
