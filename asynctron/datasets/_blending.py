"""Megatron's greedy blending: which dataset, and which of its samples, each blended sample is.

At step `n` the greedy takes the dataset whose share is furthest behind its weight,
`argmax_d(weight_d * max(n, 1) - taken_d)` in double precision, the lowest index winning ties,
exactly as megatron-core's C++ `build_blending_indices` does; `build_exhaustive_blending_indices`
takes exactly `sizes[d]` samples from each dataset, choosing among those not yet exhausted.

This is a recurrence: each choice depends on every earlier one, and no static order of the
datasets' samples reproduces it for three or more datasets, so it cannot be vectorised over
steps the way the sample index is. It runs as a plain loop over steps (about 0.2 us per step for
a few datasets: some seconds for tens of millions of samples, once; the result is cached beside
the GPT indices).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(dataset_index int16, dataset_sample_index int64)` of length `size` for normalized
    `weights`; identical to megatron-core's `helpers.build_blending_indices`."""
    _check_num_datasets(len(weights))
    return _greedy([float(w) for w in weights], size, None)


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Take exactly `sizes[d]` samples from each dataset `d`, in the greedy order; identical to
    megatron-core's `helpers.build_exhaustive_blending_indices`."""
    _check_num_datasets(len(sizes))
    counts = [int(s) for s in sizes]
    if min(counts) < 1:
        raise ValueError(f"blend sizes: expected every size >= 1, found {counts}; drop the "
                         "empty datasets from the blend")
    total = sum(counts)
    return _greedy([c / float(total) for c in counts], total, counts)


def _greedy(weight: list[float], size: int, limits: list[int] | None
            ) -> tuple[np.ndarray, np.ndarray]:
    """The greedy loop; with `limits`, a dataset leaves the race once it gave that many."""
    taken = [0] * len(weight)
    candidates = list(range(len(weight)))
    choice = [0] * size
    sample = [0] * size
    for step in range(size):
        n = float(step) if step else 1.0
        best = -1
        best_error = -math.inf
        for d in candidates:  # strict '>': the lowest index wins a tie, as in megatron
            error = weight[d] * n - taken[d]
            if error > best_error:
                best_error = error
                best = d
        choice[step] = best
        sample[step] = taken[best]
        taken[best] += 1
        if limits is not None and taken[best] == limits[best]:
            candidates.remove(best)
    return np.array(choice, np.int16), np.array(sample, np.int64)


def _check_num_datasets(num_datasets: int) -> None:
    if not 1 <= num_datasets < 32767:
        raise ValueError(f"blend: expected 1 to 32766 datasets, found {num_datasets}; the "
                         "dataset index is int16")
