"""Bucket assignment: which parameters share a bucket, and the order buckets launch in.

The rule is PyTorch DDP's `compute_bucket_assignment_by_size`
(torch/csrc/distributed/c10d/reducer.cpp), applied to the parameters in reverse registration
order, the order their gradients are expected to become ready:

- parameters are grouped by (dtype, device); each group fills its own open bucket;
- a bucket closes as soon as its bytes reach the current limit, and the next limit is taken
  from `limits_bytes` (the last one repeats), so `[first, cap]` gives one small first bucket
  per group, then buckets of `cap`;
- closed buckets come out in the order they closed, then the still-open ones, one per group,
  in the order their groups first appeared (DDP appends these in hash-map order; a fixed order
  keeps the launch order identical on every rank).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sized:
    """One parameter as the assignment sees it."""

    index: int
    """The parameter's position in registration order."""
    nbytes: int
    """Its gradient's size in the bucket's dtype."""
    key: Hashable
    """(dtype, device): only parameters with equal keys share a bucket."""


def assign_buckets(items: Sequence[Sized], limits_bytes: Sequence[int]) -> list[list[int]]:
    """Cut `items` (in readiness order) into buckets; returns each bucket's item indices,
    buckets in launch order, items in readiness order."""
    if not limits_bytes or min(limits_bytes) <= 0:
        raise ValueError(f"limits_bytes: expected one or more sizes > 0, found "
                         f"{list(limits_bytes)!r}")
    result: list[list[int]] = []
    open_buckets: dict[Hashable, tuple[list[int], list[int]]] = {}  # key -> (indices, [nbytes])
    limit_at: dict[Hashable, int] = {}
    for item in items:
        indices, size = open_buckets.setdefault(item.key, ([], [0]))
        indices.append(item.index)
        size[0] += item.nbytes
        position = limit_at.setdefault(item.key, 0)
        if size[0] >= limits_bytes[position]:
            result.append(indices)
            open_buckets[item.key] = ([], [0])
            limit_at[item.key] = min(position + 1, len(limits_bytes) - 1)
    result.extend(indices for indices, _ in open_buckets.values() if indices)
    return result
