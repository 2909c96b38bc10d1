"""Splits: the train/valid/test enum, megatron's split string ("969,30,1") and the per-dataset
sample counts of a weighted blend, computed with megatron-core's float arithmetic so the same
documents land in the same split."""

from __future__ import annotations

import enum
import itertools
import math
import re
from collections.abc import Sequence

import numpy as np


class Split(enum.Enum):
    """The three splits, numbered as megatron-core's `Split`."""

    train = 0
    valid = 1
    test = 2


SplitMatrix = list[tuple[float, float] | None]


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64 (megatron's `normalize`)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_split(split: str) -> list[float]:
    """`"969,30,1"` -> `[0.969, 0.03, 0.001]`; missing trailing parts are 0 (megatron's
    `parse_and_normalize_split`)."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not parts or len(parts) > len(Split) or sum(parts) <= 0:
        raise ValueError(f"split {split!r}: expected 1 to 3 non-negative weights with a positive "
                         f"sum, like '969,30,1', found {parts}; fix the split string")
    return normalize(parts + [0.0] * (len(Split) - len(parts)))


def split_matrix(vector: Sequence[float]) -> SplitMatrix:
    """`[0.99, 0.01, 0.0]` -> `[(0, 0.99), (0.99, 1.0), None]`: each split's book-ends as
    fractions of the documents (megatron's `convert_split_vector_to_split_matrix`)."""
    ends = [0.0]
    for part in vector:
        ends.append(ends[-1] + part)
    return [(lo, hi) if hi > lo else None for lo, hi in itertools.pairwise(ends)]


def split_bounds(bookends: tuple[float, float], num_elements: int) -> tuple[int, int]:
    """The document range `[begin, end)` one split takes from `num_elements` documents."""
    return (round(bookends[0] * float(num_elements)), round(bookends[1] * float(num_elements)))


def sizes_per_dataset(normalized_weights: Sequence[float], sizes: Sequence[int | None],
                      surplus: float = 0.0) -> list[list[int]]:
    """Samples to draw per dataset per split: `ceil(ceil(size * weight) * (1 + surplus))`
    (megatron's `_get_size_per_split_per_dataset`)."""
    if not math.isclose(sum(normalized_weights), 1.0):
        raise ValueError(f"blend weights: expected them normalized to sum 1, found "
                         f"{sum(normalized_weights)}; call normalize() first")
    return [[math.ceil(math.ceil((size or 0) * weight) * (1 + surplus)) for size in sizes]
            for weight in normalized_weights]
