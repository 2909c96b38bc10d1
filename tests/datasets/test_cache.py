"""The index cache: entries load only when complete, `must_exist` loads with no collective."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch.distributed as dist

from asynctron.datasets._cache import CacheEntry, describe, load_or_build

LAYOUT = {"a": ((np.int32,), 1, None), "b": ((np.int64,), 2, 2)}


def _arrays() -> dict[str, np.ndarray]:
    return {"a": np.arange(1000, dtype=np.int32),
            "b": np.arange(600, dtype=np.int64).reshape(300, 2)}


def _entry(directory: str) -> CacheEntry:
    description, digest = describe({"class": "Test", "n": 1000})
    return CacheEntry(directory, f"{digest}-Test-train", description)


def _builds(built: list[int]):
    def build() -> dict[str, np.ndarray]:
        built.append(1)
        return _arrays()
    return build


def _as_rank_one_of_two(monkeypatch) -> None:
    """torch.distributed seen as initialized, this process rank 1 of 2; a barrier fails."""
    def barrier() -> None:
        raise AssertionError("a barrier was entered")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "barrier", barrier)


def test_built_once_then_loaded(tmp_path) -> None:
    entry, built = _entry(str(tmp_path / "cache")), []
    first = load_or_build(entry, LAYOUT, _builds(built))
    second = load_or_build(entry, LAYOUT, _builds(built))
    assert built == [1]
    assert all(np.array_equal(first[k], second[k]) for k in LAYOUT)
    assert all(np.array_equal(np.load(entry.path(f"{k}.npy")), v) for k, v in _arrays().items())


def test_no_path_enters_a_collective(tmp_path, monkeypatch) -> None:
    """The builder orders the ranks; load_or_build never waits on one (a rank finding the
    entry missing builds it itself)."""
    entry, built = _entry(str(tmp_path / "cache")), []
    _as_rank_one_of_two(monkeypatch)
    load_or_build(entry, LAYOUT, _builds(built))
    load_or_build(entry, LAYOUT, _builds(built))
    arrays = load_or_build(entry, LAYOUT, _builds(built), must_exist=True)
    assert built == [1]
    assert all(np.array_equal(arrays[k], v) for k, v in _arrays().items())


@pytest.mark.parametrize("damage", ["missing", "no description", "other description"])
def test_must_exist_refuses_an_incomplete_entry_naming_its_description(
        tmp_path, monkeypatch, damage) -> None:
    entry, built = _entry(str(tmp_path / "cache")), []
    if damage != "missing":
        load_or_build(entry, LAYOUT, _builds(built))
        if damage == "no description":
            os.remove(entry.path("description.txt"))
        else:
            with open(entry.path("description.txt"), "w") as f:
                f.write("{}")
    _as_rank_one_of_two(monkeypatch)
    path = entry.path("description.txt")
    with pytest.raises(FileNotFoundError, match=(
            rf"^cached indices {re.escape(path)}: expected the complete cache entry this config "
            r"describes \(fast_cache_load\), found none; build the cache first with `asynctron "
            r"prepare-cache CONFIG`, or with a run without fast_cache_load$")):
        load_or_build(entry, LAYOUT, _builds(built), must_exist=True)
    assert len(built) == (damage != "missing")  # never built by must_exist
