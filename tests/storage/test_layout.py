"""Bin layout: aligned offsets, and batches that cover the file exactly once."""

from __future__ import annotations

import pytest

from asynctron.storage._layout import ALIGN_BYTES, layout_bin


def test_items_start_aligned_and_back_to_back() -> None:
    layout = layout_bin("__0_0.distcp", [2, 0, 1], [10, 5000, 0])
    assert [(p.item_index, p.offset, p.nbytes) for p in layout.placements] == [
        (2, 0, 0), (0, 0, 10), (1, 4096, 5000)]
    assert layout.nbytes == 4096 + 5000


@pytest.mark.parametrize("batch_nbytes", [4096, 8192, 3 * 4096, 1 << 20])
def test_batches_cover_every_item_byte_once(batch_nbytes: int) -> None:
    sizes = [1, 4096, 4097, 0, 123_457, 3, 20_000]
    layout = layout_bin("f", list(range(len(sizes))), sizes)
    seen = {i: [] for i in range(len(sizes))}
    cursor = 0
    for batch in layout.batches(batch_nbytes):
        assert batch.file_offset == cursor and 0 < batch.nbytes <= batch_nbytes
        cursor += batch.nbytes
        for s in batch.segments:
            place = next(p for p in layout.placements if p.item_index == s.item_index)
            assert place.offset + s.item_offset == batch.file_offset + s.batch_offset
            seen[s.item_index].append((s.item_offset, s.nbytes))
    assert cursor == layout.nbytes
    for index, pieces in seen.items():
        offsets = sorted(pieces)
        assert sum(n for _, n in offsets) == sizes[index]
        position = 0
        for offset, n in offsets:
            assert offset == position
            position += n


def test_batch_size_must_be_at_least_one_block() -> None:
    with pytest.raises(ValueError, match=rf"^batch_nbytes: expected >= {ALIGN_BYTES}, found 100$"):
        next(layout_bin("f", [0], [10]).batches(100))
