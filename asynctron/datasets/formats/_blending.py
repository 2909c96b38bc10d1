"""Megatron's greedy blending: which dataset, and which of its samples, each blended sample is.

At step `n` the greedy takes the dataset whose share is furthest behind its weight,
`argmax_d(weight_d * max(n, 1) - taken_d)` in double precision, the lowest index winning ties;
`build_exhaustive_blending_indices` takes exactly `sizes[d]` samples from each dataset, choosing
among those not yet exhausted. Both return arrays identical, element for element, to those of
megatron-core's C++ helpers (`build_blending_indices`, `build_exhaustive_blending_indices`):
the loop is compiled C (`_blending.c`) doing megatron's arithmetic term for term.

This is a recurrence: each choice depends on every earlier one, and no static order of the
datasets' samples reproduces it for three or more datasets, so it cannot be vectorised over
steps the way the sample index is. Cost, as megatron's: about 10 ns a step for a few datasets
and 1 ns more per dataset (50 M samples of 3 datasets: 0.5 s; 1 B of 10: 25 s, half of it the
kernel faulting in the fresh output), without the GIL; memory: the two output arrays (10 bytes a
sample) and one count per dataset.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from asynctron.datasets.formats import _blending_native


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(dataset_index int16, dataset_sample_index int64)` of length `size` for normalized
    `weights` (finite, >= 0; 1 to 32766 of them); identical to megatron-core's
    `helpers.build_blending_indices`."""
    size = operator.index(size)
    if size < 0:
        raise ValueError(f"blend size: expected >= 0 samples, found {size}")
    dataset_index = np.empty(size, np.int16)
    sample_index = np.empty(size, np.int64)
    _blending_native.blend(dataset_index, sample_index, np.array(weights, np.float64, ndmin=1))
    return dataset_index, sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Take exactly `sizes[d]` (>= 1) samples from each dataset `d`, in the greedy order;
    identical to megatron-core's `helpers.build_exhaustive_blending_indices`."""
    counts = [operator.index(s) for s in sizes]
    if any(c < 1 for c in counts):
        raise ValueError(f"blend sizes: expected every size >= 1, found {counts}; drop the "
                         "empty datasets from the blend")
    total = sum(counts)
    dataset_index = np.empty(total, np.int16)
    sample_index = np.empty(total, np.int64)
    _blending_native.blend_exhaustive(dataset_index, sample_index, np.array(counts, np.int64))
    return dataset_index, sample_index
