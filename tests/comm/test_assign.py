"""Bucket assignment follows DDP's rule on the parameters in reverse registration order."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from asynctron.comm._assign import Sized, assign_buckets


@pytest.mark.parametrize("seed", range(5))
def test_matches_ddp_compute_bucket_assignment_by_size(seed: int) -> None:
    rng = random.Random(seed)
    params = [torch.empty(rng.choice([1, 7, 300, 4096, 70_000, 300_000])) for _ in range(40)]
    limits = [rng.choice([1 << 10, 1 << 16]), rng.choice([1 << 18, 1 << 20])]
    order = list(range(len(params)))[::-1]  # readiness: reverse registration
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, [False] * len(params), order)
    ours = assign_buckets([Sized(i, params[i].numel() * 4, "f32") for i in order], limits)
    assert ours == theirs


def test_one_small_first_bucket_per_dtype_and_open_buckets_last() -> None:
    items = [Sized(0, 600, "a"), Sized(1, 600, "b"), Sized(2, 500, "a"), Sized(3, 2000, "a"),
             Sized(4, 100, "b"), Sized(5, 700, "a")]
    assert assign_buckets(items, [1000, 2000]) == [[0, 2], [3], [5], [1, 4]]


def test_a_parameter_larger_than_the_cap_gets_a_bucket_of_its_own() -> None:
    items = [Sized(0, 10, "a"), Sized(1, 5000, "a"), Sized(2, 10, "a")]
    assert assign_buckets(items, [4000]) == [[0, 1], [2]]


@pytest.mark.parametrize("limits", [[], [1024, 0]])
def test_bad_limits(limits: list[int]) -> None:
    with pytest.raises(ValueError, match=r"^limits_bytes: expected one or more sizes > 0, found "):
        assign_buckets([Sized(0, 4, "a")], limits)
