"""`dcp.load` through `asynctron.dcp.StorageReader` into targets it cannot read straight into
(CUDA tensors on a GPU; strided CPU tensors here, the same path): filled through the runtime's
slabs, no temporary chunk of their own, every byte exact, a damaged item named, the budget
whole afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asynctron.dcp import StorageReader, StorageWriter, _read_job
from tests.conftest import assert_same

SMALL = {"memory_budget_bytes": 256 << 10, "slab_bytes": 64 << 10}


def _saved() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    saved = {f"small{i}": torch.randn(9, 4, generator=generator) for i in range(200)}
    saved["large"] = torch.randn(400, 100, generator=generator)  # 160 KB: three slabs' worth
    saved["half"] = torch.randn(17, 8, generator=generator).to(torch.bfloat16)
    return saved


def _strided_like(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.zeros(tuple(reversed(value.shape)), dtype=value.dtype).t()
            for key, value in saved.items()}


def _counting_temporaries(monkeypatch: Any) -> list[int]:
    made: list[int] = []
    real = _read_job._temporary

    def temporary(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append(torch.Size(shape).numel() * dtype.itemsize)
        return real(shape, dtype)

    monkeypatch.setattr(_read_job, "_temporary", temporary)
    return made


def test_strided_targets_are_filled_through_slabs_exactly(tmp_path: Any,
                                                          monkeypatch: Any) -> None:
    saved = _saved()
    dcp.save(saved, storage_writer=StorageWriter(f"{tmp_path}/c", num_bins=2))
    made = _counting_temporaries(monkeypatch)
    target = _strided_like(saved)
    reader = StorageReader(f"{tmp_path}/c", **SMALL)
    dcp.load(target, storage_reader=reader)
    assert made == []  # no chunk of its own: every item went through the slabs
    assert all(not value.is_contiguous() for value in target.values())
    assert_same(saved, target)
    assert reader._started().pool.budget.borrowed_bytes == 0


@pytest.mark.parametrize("key", ["small13", "large"])
def test_a_damaged_item_filled_through_slabs_is_named(tmp_path: Any, key: str) -> None:
    """`small13` is read packed with others; `large` in pieces, checked after the last."""
    saved = _saved()
    path = f"{tmp_path}/c"
    dcp.save(saved, storage_writer=StorageWriter(path, num_bins=1))
    with open(f"{path}/__0_0.distcp", "r+b") as file:
        content = file.read()
        at = content.index(saved[key].numpy().tobytes()) + saved[key].nbytes - 1
        file.seek(at)
        file.write(bytes([content[at] ^ 0x10]))
    reader = StorageReader(path, **SMALL)
    with pytest.raises(CheckpointException, match=rf"item '{key}' in .*__0_0\.distcp"):
        dcp.load(_strided_like(saved), storage_reader=reader)
    assert reader._started().pool.budget.borrowed_bytes == 0

