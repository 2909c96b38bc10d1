"""The chunk index finds exactly the saved chunks a wanted box overlaps, without a scan."""

from __future__ import annotations

import itertools
import math
import random

import torch

from asynctron.storage.format._chunk_index import MAX_RUNS_PER_CHUNK, ChunkIndex, Overlap
from asynctron.storage.format._manifest import ItemRecord


def _grid(rows: int, cols: int, row_step: int, col_step: int) -> list[ItemRecord]:
    return [ItemRecord(key="w", kind="tensor", file="__0_0.distcp", offset=(r * cols + c) * 4096,
                       nbytes=row_step * col_step * 4, checksum=None, dtype="float32",
                       shape=(row_step, col_step),
                       global_shape=(rows * row_step, cols * col_step),
                       chunk_offsets=(r * row_step, c * col_step))
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


def _chunk(shape: tuple[int, ...], offsets: tuple[int, ...], file_offset: int = 4096
           ) -> ItemRecord:
    return ItemRecord(key="w", kind="tensor", file="__0_0.distcp", offset=file_offset,
                      nbytes=4 * math.prod(shape), checksum="xxh3:0", dtype="float32",
                      shape=shape, chunk_offsets=offsets)


def _shift(origin: tuple[int, ...], by: list[int]) -> tuple[int, ...]:
    return tuple(a + b for a, b in zip(origin, by, strict=True))


def test_runs_hold_exactly_the_box_bytes_in_row_major_order() -> None:
    rng = random.Random(1)
    for _ in range(300):
        shape = tuple(rng.randrange(1, 6) for _ in range(rng.randrange(1, 4)))
        origin = tuple(rng.randrange(0, 3) for _ in shape)
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        file = torch.cat([torch.full((1024,), -1.0), full.reshape(-1)])  # item at byte 4096
        lo = [rng.randrange(0, n) for n in shape]
        hi = [rng.randrange(low + 1, n + 1) for low, n in zip(lo, shape, strict=True)]
        overlap = Overlap(_chunk(shape, origin), _shift(origin, lo), _shift(origin, hi))
        runs, box_lo, box_hi = overlap.runs(min_gap_bytes=rng.choice([0, 8, 1 << 20]))
        read = torch.cat([file[r.offset // 4:(r.offset + r.nbytes) // 4] for r in runs])
        box = full[tuple(slice(a - o, b - o)
                         for a, b, o in zip(box_lo, box_hi, origin, strict=True))]
        assert torch.equal(read, box.reshape(-1))
        assert all(a <= c and d <= b for a, b, c, d in zip(
            box_lo, box_hi, overlap.lo, overlap.hi, strict=True))
        assert all(r.checksum is None for r in runs)
        assert [r.offset for r in runs] == sorted(r.offset for r in runs)


def test_a_column_shard_reads_each_rows_part_when_rows_are_far_apart() -> None:
    wide = _chunk((4, 65536), (0, 0))  # rows of 256 KiB
    runs, lo, hi = Overlap(wide, (0, 32768), (4, 65536)).runs(min_gap_bytes=64 << 10)
    assert (lo, hi) == ((0, 32768), (4, 65536))
    assert [(r.offset, r.nbytes) for r in runs] == [
        (4096 + row * (256 << 10) + (128 << 10), 128 << 10) for row in range(4)]

    narrow = _chunk((4, 100), (0, 0))  # the gaps are cheaper read than skipped
    runs, lo, hi = Overlap(narrow, (0, 50), (4, 100)).runs(min_gap_bytes=64 << 10)
    assert (lo, hi) == ((0, 0), (4, 100)) and [(r.offset, r.nbytes) for r in runs] == [
        (4096, 1600)]

    tall = _chunk((MAX_RUNS_PER_CHUNK + 1, 65536), (0, 0))  # too many runs: whole rows
    runs, lo, hi = Overlap(tall, (0, 0), (MAX_RUNS_PER_CHUNK + 1, 10)).runs(64 << 10)
    assert len(runs) == 1 and (lo, hi) == ((0, 0), (MAX_RUNS_PER_CHUNK + 1, 65536))


def test_rows_of_a_row_chunk_are_one_run() -> None:
    rows = _chunk((10, 6), (10, 0))
    runs, lo, hi = Overlap(rows, (12, 0), (15, 6)).runs(min_gap_bytes=64 << 10)
    assert (lo, hi) == ((12, 0), (15, 6))
    assert [(r.offset, r.nbytes, r.chunk_offsets, r.shape) for r in runs] == [
        (4096 + 2 * 24, 3 * 24, (12, 0), (3, 6))]
