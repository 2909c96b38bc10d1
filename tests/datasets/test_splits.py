"""Split strings and blend sizes, with megatron-core's float arithmetic."""

from __future__ import annotations

import math

import pytest

from asynctron.datasets.formats._splits import (
    normalize,
    parse_split,
    sizes_per_dataset,
    split_bounds,
    split_matrix,
)

SPLITS = ["969,30,1", "99,1", "1", "98,2,0", "0.9,0.05,0.05", "1,1,1", "0,1,0", "7,0,3"]


@pytest.mark.parametrize("split", SPLITS)
def test_split_matrix_is_megatrons(megatron, split: str) -> None:
    vector = parse_split(split)
    assert vector == megatron.parse_split(split)
    assert split_matrix(vector) == megatron.split_matrix(vector)


def test_split_bounds_round_like_megatron() -> None:
    matrix = split_matrix(parse_split("969,30,1"))
    assert [split_bounds(b, 1000) for b in matrix if b] == [(0, 969), (969, 999), (999, 1000)]
    assert split_matrix(parse_split("99,1")) [2] is None


def test_sizes_per_dataset_with_surplus() -> None:
    weights = normalize([30, 70])
    assert sizes_per_dataset(weights, [100, 10, 0]) == [[30, 3, 0], [70, 7, 0]]
    assert sizes_per_dataset(weights, [100, 10, 0], surplus=0.005) == [
        [math.ceil(30 * 1.005), math.ceil(3 * 1.005), 0], [71, 8, 0]]
    with pytest.raises(ValueError, match=r"^blend weights: expected them normalized"):
        sizes_per_dataset([1, 2], [10, 0, 0])


@pytest.mark.parametrize("bad", ["", "a,b", "0,0", "1,2,3,4"])
def test_bad_split_strings(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"^split {bad!r}: expected 1 to 3 non-negative"):
        parse_split(bad)
