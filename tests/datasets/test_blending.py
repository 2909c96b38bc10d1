"""Megatron's greedy blending, identical to its C++ helpers (ties and float rounding too)."""

from __future__ import annotations

import numpy as np
import pytest

from asynctron.datasets import build_blending_indices, build_exhaustive_blending_indices
from asynctron.datasets._splits import normalize

WEIGHTS = [
    [1.0],
    [0.5, 0.5],
    [0.3, 0.7],
    [1 / 3, 1 / 3, 1 / 3],
    [0.2208, 0.7616, 0.0175],
    [5, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    list(np.random.default_rng(0).random(12) ** 3),
]


@pytest.mark.parametrize("weights", WEIGHTS, ids=lambda w: f"{len(w)}-datasets")
def test_blending_indices_are_megatrons(megatron, weights: list[float]) -> None:
    normalized = normalize(weights)
    size = 20_011
    dataset_index = np.zeros(size, np.int16)
    sample_index = np.zeros(size, np.int64)
    megatron.helpers.build_blending_indices(dataset_index, sample_index,
                                            np.array(normalized), len(normalized), size, False)
    ours = build_blending_indices(normalized, size)
    assert ours[0].dtype == np.int16 and ours[1].dtype == np.int64
    assert np.array_equal(ours[0], dataset_index)
    assert np.array_equal(ours[1], sample_index)


@pytest.mark.parametrize("sizes", [[1], [3, 3], [10, 1, 7], [1000, 3, 250, 40]])
def test_exhaustive_blending_indices_are_megatrons(megatron, sizes: list[int]) -> None:
    total = sum(sizes)
    dataset_index = np.zeros(total, np.int16)
    sample_index = np.zeros(total, np.int64)
    megatron.helpers.build_exhaustive_blending_indices(
        dataset_index, sample_index, np.array(sizes, np.int64), len(sizes))
    ours = build_exhaustive_blending_indices(sizes)
    assert np.array_equal(ours[0], dataset_index)
    assert np.array_equal(ours[1], sample_index)
    assert np.bincount(ours[0]).tolist() == sizes


def test_proportions_and_errors() -> None:
    dataset_index, sample_index = build_blending_indices([0.25, 0.75], 1000)
    assert np.bincount(dataset_index).tolist() == [250, 750]
    assert sample_index[dataset_index == 1].tolist() == list(range(750))
    with pytest.raises(ValueError, match=r"^blend: expected 1 to 32766 datasets, found 0; "):
        build_blending_indices([], 10)
    with pytest.raises(ValueError, match=r"^blend sizes: expected every size >= 1, found "
                                         r"\[3, 0\]; drop the empty datasets"):
        build_exhaustive_blending_indices([3, 0])
