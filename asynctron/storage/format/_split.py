"""The splitter: write items dealt onto bins (one bin = one file = one writer task).

Megatron's `_split_by_size_and_type` (seed 000): bytes items round-robin; tensor items sorted
largest-first and each put on the currently lightest bin (a min-heap of (bytes, bin index)).
Tensor size is the item's LOCAL chunk, not the global tensor (Megatron's fix over DCP). As in
Megatron, bytes items do not count toward a bin's weight in the heap.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from torch.distributed.checkpoint.planner import WriteItemType


class _Typed(Protocol):
    @property
    def type(self) -> WriteItemType: ...


Item = TypeVar("Item", bound=_Typed)


def split_by_size_and_type(
    num_bins: int, items: Sequence[Item], nbytes: Callable[[Item], int]
) -> list[list[Item]]:
    """Deal `items` onto `num_bins` bins; returns one list per bin (some may be empty).

    Deterministic: the same items in the same order give the same bins (ties keep input order).
    """
    if num_bins < 1:
        raise ValueError(f"num_bins: expected >= 1, found {num_bins!r}")
    if num_bins == 1:
        return [list(items)]
    bins: list[list[Item]] = [[] for _ in range(num_bins)]
    bytes_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
    tensor_items = [item for item in items if item.type != WriteItemType.BYTE_IO]
    for i, item in enumerate(bytes_items):
        bins[i % num_bins].append(item)
    sized = sorted(((item, nbytes(item)) for item in tensor_items), key=lambda p: -p[1])
    heap = [(0, i) for i in range(num_bins)]
    for item, size in sized:
        total, index = heapq.heappop(heap)
        bins[index].append(item)
        heapq.heappush(heap, (total + size, index))
    return bins
