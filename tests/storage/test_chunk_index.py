"""The chunk index finds exactly the saved chunks a wanted box overlaps, without a scan."""

from __future__ import annotations

import itertools
import random

from asynctron.storage._chunk_index import ChunkIndex
from asynctron.storage._manifest import ItemRecord


def _grid(rows: int, cols: int, row_step: int, col_step: int) -> list[ItemRecord]:
    return [ItemRecord("w", "tensor", "float32", (row_step, col_step), (rows * row_step,
                                                                       cols * col_step),
                       (r * row_step, c * col_step), "__0_0.distcp", (r * cols + c) * 4096,
                       row_step * col_step * 4, None)
            for r, c in itertools.product(range(rows), range(cols))]


def _brute(records: list[ItemRecord], offsets: tuple, shape: tuple) -> set:
    found = set()
    for record in records:
        assert record.chunk_offsets is not None and record.shape is not None
        if all(max(o, r) < min(o + s, r + n) for o, s, r, n in zip(
                offsets, shape, record.chunk_offsets, record.shape, strict=True)):
            found.add(record.chunk_offsets)
    return found


def test_agrees_with_a_brute_force_scan_on_random_boxes() -> None:
    records = _grid(8, 5, 16, 12)
    index = ChunkIndex(records)
    rng = random.Random(0)
    for _ in range(500):
        lo = (rng.randrange(128), rng.randrange(60))
        shape = (rng.randrange(1, 129 - lo[0]), rng.randrange(1, 61 - lo[1]))
        found = index.overlapping(lo, shape)
        assert {o.record.chunk_offsets for o in found} == _brute(records, lo, shape)
        for o in found:
            assert all(lo[d] <= o.lo[d] < o.hi[d] <= lo[d] + shape[d] for d in range(2))


def test_whole_chunks_are_marked_covered_and_parts_are_not() -> None:
    index = ChunkIndex(_grid(4, 1, 10, 6))  # row shards of a 40 x 6 tensor
    same = index.overlapping((10, 0), (10, 6))
    assert [(o.lo, o.hi, o.covers_record) for o in same] == [((10, 0), (20, 6), True)]
    halves = index.overlapping((5, 0), (10, 6))
    assert [(o.lo, o.hi, o.covers_record) for o in halves] == [
        ((5, 0), (10, 6), False), ((10, 0), (15, 6), False)]


def test_a_query_touches_few_candidates_in_a_large_grid() -> None:
    """90,000 saved chunks: a box meets only the chunks of its rows and columns."""
    records = _grid(300, 300, 1, 1)
    index = ChunkIndex(records)
    assert len(index.overlapping((150, 150), (2, 3))) == 6
