"""Megatron's greedy blending, identical to its C++ helpers (ties and float rounding too), in
the memory of its output."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from asynctron.datasets import build_blending_indices, build_exhaustive_blending_indices
from asynctron.datasets.formats import _blending_native
from asynctron.datasets.formats._splits import normalize

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


def _random_weights(rng: np.random.Generator, kind: str, num_datasets: int) -> np.ndarray:
    """Weights of one `kind`: ties, tiny and zero weights are where a rounding or tie rule that
    differs from megatron's shows."""
    if kind == "uniform":
        w = rng.random(num_datasets)
    elif kind == "heavy-tailed":
        w = rng.random(num_datasets) ** 6
    elif kind == "equal":
        w = np.ones(num_datasets)
    elif kind == "few-values":  # many ties among datasets
        w = rng.choice([1.0, 2.0, 3.0], num_datasets)
    elif kind == "tiny":  # one dataset dominates; the others' shares round near nothing
        w = np.full(num_datasets, 1e-12)
        w[rng.integers(num_datasets)] = 1.0
    else:  # "zeros": some datasets weigh nothing
        w = rng.random(num_datasets) * (rng.random(num_datasets) < 0.7)
        w[rng.integers(num_datasets)] = 1.0
    return w / w.sum() if rng.random() < 0.8 else w  # unnormalized sometimes: megatron allows it


def _megatron_blend(megatron, weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    dataset_index = np.full(size, -1, np.int16)
    sample_index = np.full(size, -1, np.int64)
    megatron.helpers.build_blending_indices(dataset_index, sample_index, weights, len(weights),
                                            size, False)
    return dataset_index, sample_index


@pytest.mark.parametrize("kind", ["uniform", "heavy-tailed", "equal", "few-values", "tiny",
                                  "zeros"])
def test_random_blends_are_megatrons(megatron, kind: str) -> None:
    rng = np.random.default_rng(sum(map(ord, kind)))
    for size in [0, 1, 2, 3, *rng.integers(4, 200_001, size=9).tolist()]:
        weights = _random_weights(rng, kind, int(rng.integers(1, 51)))
        expected = _megatron_blend(megatron, weights, size)
        ours = build_blending_indices(weights.tolist(), size)
        assert np.array_equal(ours[0], expected[0]), (kind, size, weights.tolist())
        assert np.array_equal(ours[1], expected[1]), (kind, size, weights.tolist())


@pytest.mark.parametrize("kind", ["uniform", "equal", "ones", "one-big"])
def test_random_exhaustive_blends_are_megatrons(megatron, kind: str) -> None:
    rng = np.random.default_rng(sum(map(ord, kind)))
    for _ in range(10):
        num_datasets = int(rng.integers(1, 51))
        total = int(rng.integers(num_datasets, 200_001))
        if kind == "uniform":
            sizes = rng.multinomial(total - num_datasets, np.ones(num_datasets) / num_datasets) + 1
        elif kind == "equal":  # every step a tie until the datasets run out together
            sizes = np.full(num_datasets, max(1, total // num_datasets))
        elif kind == "ones":
            sizes = np.ones(num_datasets, np.int64)
        else:
            sizes = np.ones(num_datasets, np.int64)
            sizes[rng.integers(num_datasets)] = total
        sizes = sizes.astype(np.int64)
        dataset_index = np.full(int(sizes.sum()), -1, np.int16)
        sample_index = np.full(int(sizes.sum()), -1, np.int64)
        megatron.helpers.build_exhaustive_blending_indices(dataset_index, sample_index, sizes,
                                                           num_datasets)
        ours = build_exhaustive_blending_indices(sizes.tolist())
        assert np.array_equal(ours[0], dataset_index), (kind, sizes.tolist())
        assert np.array_equal(ours[1], sample_index), (kind, sizes.tolist())


@pytest.mark.parametrize(("weights", "size", "error", "message"), [
    ([1.0], -1, ValueError, r"^blend size: expected >= 0 samples, found -1$"),
    ([1.0], 2.5, TypeError, r"integer"),
    ([1.0] * 32767, 1, ValueError, r"^blend: expected 1 to 32766 datasets, found 32767; "),
    ([0.5, float("nan")], 1, ValueError,
     r"^blend weights: expected finite weights >= 0, found nan for dataset 1$"),
    ([float("inf"), 0.5], 1, ValueError,
     r"^blend weights: expected finite weights >= 0, found inf for dataset 0$"),
    ([0.5, -0.25, 0.75], 1, ValueError,
     r"^blend weights: expected finite weights >= 0, found -0.25 for dataset 1$"),
    ([[0.5, 0.5]], 1, ValueError, r"^blend: expected weights \(float64\) as a 1-D array"),
])
def test_bad_blends_are_refused(weights: list, size: float, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        build_blending_indices(weights, size)  # type: ignore[arg-type]


@pytest.mark.parametrize(("sizes", "error", "message"), [
    ([], ValueError, r"^blend: expected 1 to 32766 datasets, found 0; "),
    ([4, -2], ValueError, r"^blend sizes: expected every size >= 1, found \[4, -2\]; "),
    ([4, 2.0], TypeError, r"integer"),
])
def test_bad_exhaustive_blends_are_refused(sizes: list, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        build_exhaustive_blending_indices(sizes)


def test_the_native_loops_check_their_buffers() -> None:
    """The C functions refuse buffers they would misread or overrun, naming what is wrong."""
    di, si = np.empty(4, np.int16), np.empty(4, np.int64)
    weights, sizes = np.array([0.5, 0.5]), np.array([3, 1], np.int64)
    with pytest.raises(ValueError, match=r"^blend: expected dataset_index \(int16\) as a 1-D "
                                         r"array of 2-byte items \(format 'h'\), found 1-D of "
                                         r"4-byte items \(format 'i'\)$"):
        _blending_native.blend(np.empty(4, np.int32), si, weights)
    with pytest.raises(ValueError, match=r"dataset_sample_index \(int64\) .* 1-D of 8-byte "
                                         r"items \(format 'd'\)$"):
        _blending_native.blend(di, np.empty(4), weights)
    with pytest.raises(ValueError, match=r"^blend: expected dataset_sample_index as long as "
                                         r"dataset_index \(4\), found 5$"):
        _blending_native.blend(di, np.empty(5, np.int64), weights)
    with pytest.raises(ValueError, match=r"sizes \(int64\) as a 1-D array"):
        _blending_native.blend_exhaustive(di, si, np.array([3, 1], np.int32))
    with pytest.raises(ValueError, match=r"^blend sizes: expected them to sum to the output "
                                         r"length 4, found 5$"):
        _blending_native.blend_exhaustive(di, si, np.array([3, 2], np.int64))
    with pytest.raises(ValueError, match=r"^blend sizes: expected every size >= 1, found 0 for "
                                         r"dataset 1; "):
        _blending_native.blend_exhaustive(di, si, np.array([4, 0], np.int64))
    with pytest.raises(ValueError, match=r"^blend sizes: expected a total below 2\*\*63, found "
                                         r"it past that at dataset 1"):
        _blending_native.blend_exhaustive(di, si, np.array([2**62, 2**62], np.int64))
    read_only = np.empty(4, np.int16)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _blending_native.blend(read_only, si, weights)
    with pytest.raises(ValueError, match="contiguous"):
        _blending_native.blend(np.empty(8, np.int16)[::2], si, weights)
    with pytest.raises(TypeError, match=r"^blend_exhaustive: expected 3 arguments"):
        _blending_native.blend_exhaustive(di, si)
    _blending_native.blend_exhaustive(di, si, sizes)
    assert di.tolist() == [0, 1, 0, 0] and si.tolist() == [0, 0, 1, 2]


@pytest.mark.parametrize("exhaustive", [False, True], ids=["weighted", "exhaustive"])
def test_memory_is_the_output_and_a_constant(exhaustive: bool) -> None:
    """5 M samples allocate their 50 MB of output and a few KiB more (the Python loop this
    replaced built lists of 10 times that)."""
    size = 5_000_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        if exhaustive:
            build_exhaustive_blending_indices([size // 10 * 2, size // 10 * 3, size // 2])
        else:
            build_blending_indices([0.2, 0.3, 0.5], size)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert size * 10 <= peak <= size * 10 + 64 * 1024, peak
