"""Bin layout: aligned items, and batches whose segments and gaps cover the file exactly once."""

from __future__ import annotations

import random

import numpy as np
import pytest

from asynctron.storage.format._layout import ALIGN_BYTES, Part, layout_bin


def test_items_start_aligned_and_pack_small_ones() -> None:
    layout = layout_bin("__0_0.distcp", [2, 0, 1, 3], [(10,), (5000,), (0,), (1,)])
    assert layout.item.tolist() == [2, 0, 1, 3]
    assert layout.offset.tolist() == [0, 0, 4096, 4096 + 5000 + 56]
    assert layout.nbytes == 4096 + 5000 + 57
    assert layout.body_offsets() == {2: 0, 0: 0, 1: 4096, 3: 9152}


def test_frames_surround_their_body_without_gaps() -> None:
    layout = layout_bin("f", [0, 1], [(3, 5000, 2), (7, 1, 1)])
    assert layout.part.tolist() == [Part.HEAD, Part.BODY, Part.TAIL] * 2
    assert layout.offset.tolist() == [0, 3, 5003, 5056, 5063, 5064]
    assert layout.body_offsets() == {0: 3, 1: 5063}


def _check_batches(layout: object, slab_bytes: int) -> None:
    """Each batch: its segments and gaps, in order, tile [0, batch size) exactly; every
    piece's bytes appear once, in order, at their file offsets."""
    batches = layout.batches(slab_bytes)  # type: ignore[attr-defined]
    file = np.full(layout.nbytes, -1, dtype=np.int64)  # type: ignore[attr-defined]
    total = 0
    for index in range(len(batches)):
        size = batches.batch_bytes(index)
        assert 0 < size <= slab_bytes and batches.file_offset(index) == total
        spans = []
        segments, gaps = batches.segments(index), batches.gaps(index)
        for piece, start, at, n in zip(batches.piece[segments], batches.piece_offset[segments],
                                       batches.batch_offset[segments], batches.size[segments],
                                       strict=True):
            assert n > 0
            spans.append((int(at), int(n)))
            assert layout.offset[piece] + start == total + at  # type: ignore[attr-defined]
            file[total + at:total + at + n] = piece
        spans += [(int(at), int(n)) for at, n in zip(batches.gap_offset[gaps],
                                                    batches.gap_size[gaps], strict=True)]
        cursor = 0
        for at, n in sorted(spans):
            assert at == cursor and n > 0
            cursor += n
        assert cursor == size
        total += size
    assert total == layout.nbytes  # type: ignore[attr-defined]
    for piece, (offset, size) in enumerate(zip(layout.offset, layout.size, strict=True)):  # type: ignore[attr-defined]
        assert (file[offset:offset + size] == piece).all()


@pytest.mark.parametrize("slab_bytes", [4096, 8192, 3 * 4096, 1 << 20])
def test_batches_cover_every_piece_byte_once(slab_bytes: int) -> None:
    sizes = [(1,), (4096,), (4097,), (0,), (123_457,), (3,), (20_000,), (60, 5, 30)]
    _check_batches(layout_bin("f", list(range(len(sizes))), sizes), slab_bytes)


def test_random_layouts_tile_their_batches() -> None:
    rng = random.Random(0)
    for _ in range(50):
        count = rng.randrange(1, 40)
        sizes = [(rng.choice([0, 1, 7, 64, 4095, 4096, 9000, 70_000]),) if rng.random() < 0.7
                 else (rng.randrange(1, 100), rng.randrange(0, 9000), rng.randrange(1, 20))
                 for _ in range(count)]
        order = list(range(count))
        rng.shuffle(order)
        _check_batches(layout_bin("f", order, sizes), rng.choice([4096, 8192, 65536]))


def test_batch_size_must_be_at_least_one_block() -> None:
    with pytest.raises(ValueError, match=rf"^slab_bytes: expected >= {ALIGN_BYTES}, found 100$"):
        layout_bin("f", [0], [(10,)]).batches(100)
