"""A key's chunks must tile its tensor: the manifest check refuses overlaps and gaps."""

from __future__ import annotations

import pytest

from asynctron.errors import CorruptCheckpointError
from asynctron.storage._manifest import ItemRecord, check_chunks


def _tile(offsets: tuple[int, int], shape: tuple[int, int] = (2, 2)) -> ItemRecord:
    return ItemRecord("w", "tensor", "float32", shape, (4, 4), offsets, "__0_0.distcp", 0,
                      4 * shape[0] * shape[1], None)


def _fail(what: str, key: str | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(what, path="manifest.json", key=key)


def test_four_tiles_of_a_square_pass() -> None:
    check_chunks([_tile((0, 0)), _tile((0, 2)), _tile((2, 0)), _tile((2, 2))], _fail)


def test_many_row_chunks_pass_quickly() -> None:
    rows = [ItemRecord("w", "tensor", "float32", (1, 8), (20_000, 8), (i, 0), "__0_0.distcp",
                       0, 32, None) for i in range(20_000)]
    check_chunks(rows, _fail)


@pytest.mark.parametrize(("tiles", "message"), [
    ([_tile((0, 0)), _tile((0, 2)), _tile((2, 0)), _tile((1, 1))],
     r"item 'w': chunk at \[1, 1\] of shape \[2, 2\] overlaps the chunk at \[0, 0\]"),
    ([_tile((0, 0)), _tile((0, 2)), _tile((2, 0))],
     r"item 'w': expected chunks covering all 16 elements of shape \[4, 4\], found 12"),
    ([_tile((0, 0), (4, 2)), _tile((0, 2), (4, 2)), _tile((2, 2))],
     r"item 'w': chunk at \[2, 2\] of shape \[2, 2\] overlaps the chunk at \[0, 2\]"),
])
def test_overlaps_and_gaps_are_refused_naming_the_key(tiles: list[ItemRecord],
                                                      message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=rf"^{message}") as raised:
        check_chunks(tiles, _fail)
    assert raised.value.key == "w"
