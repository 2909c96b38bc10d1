"""Batch slabs: a slab's tensors are handed out again only once nothing refers to them."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.dlpack

from asynctron.datasets.loader import _shared_slabs
from asynctron.datasets.loader._shared_slabs import SharedSlabs


def _views(slab: np.ndarray) -> dict[str, torch.Tensor]:
    return {"tokens": torch.from_numpy(np.frombuffer(slab, np.int64, 8, 0).reshape(2, 4)),
            "loss_mask": torch.from_numpy(np.frombuffer(slab, np.float32, 8, 64).reshape(2, 4))}


@pytest.fixture
def slabs():
    slabs = SharedSlabs(4096, _views)
    yield slabs
    slabs.close()


def _embedded(batch: dict[str, torch.Tensor]) -> Any:
    """A graph that keeps the tokens for its backward pass (a C++ reference only)."""
    weight = torch.randn(16, 3, requires_grad=True)
    return torch.nn.functional.embedding(batch["tokens"], weight).sum()


def _future_of(batch: dict[str, torch.Tensor]) -> Any:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(batch["tokens"])
    return future


HOLDERS: dict[str, Callable[[dict[str, torch.Tensor]], Any]] = {
    "the batch dict": lambda batch: batch,
    "one tensor": lambda batch: batch["loss_mask"],
    "a slice of a tensor": lambda batch: batch["tokens"][1],
    "a numpy array of a tensor": lambda batch: batch["tokens"].numpy(),
    "autograd, for the backward pass": _embedded,
    "a DLPack capsule": lambda batch: torch.utils.dlpack.to_dlpack(batch["loss_mask"]),
    "a torch Future's result": _future_of,
}


@pytest.mark.parametrize("holder", HOLDERS.values(), ids=HOLDERS.keys())
def test_a_slab_comes_back_only_once_nothing_holds_its_tensors(slabs, holder) -> None:
    first = slabs.take()
    batch = slabs.lend(first)
    tensors = [weakref.ref(t) for t in batch.values()]  # not a reference that holds
    held = holder(batch)
    del batch
    assert slabs.num_lent == 1
    assert slabs.take() != first  # held: another slab
    del held
    assert slabs.num_lent == 0
    assert slabs.take() == first
    again = slabs.lend(first)
    assert all(a is b() for a, b in zip(again.values(), tensors, strict=True))  # none freed


def test_a_tensor_changed_in_place_is_made_anew(slabs) -> None:
    index = slabs.take()
    batch = slabs.lend(index)
    batch["tokens"].unsqueeze_(0)
    batch["loss_mask"].requires_grad_()
    old = weakref.ref(batch["tokens"])
    pointer = batch["tokens"].data_ptr()
    del batch
    assert slabs.take() == index  # nothing holds it
    batch = slabs.lend(index)
    assert old() is None  # the changed one is gone
    assert batch["tokens"].shape == (2, 4) and not batch["loss_mask"].requires_grad
    assert batch["tokens"].data_ptr() == pointer


def test_writes_into_a_slab_show_in_its_tensors(slabs) -> None:
    index = slabs.take()
    batch = slabs.lend(index)
    start = index * slabs.slab_bytes
    memory = np.frombuffer(slabs._memory[start:start + 64], np.int64)
    memory[:] = np.arange(8)
    assert batch["tokens"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_batch_held_past_close_stays_readable() -> None:
    slabs = SharedSlabs(4096, _views)
    index = slabs.take()
    batch = slabs.lend(index)
    batch["tokens"].copy_(torch.arange(8).reshape(2, 4))
    slabs.close()
    assert batch["tokens"].sum().item() == 28


def test_every_slab_held_is_an_error_that_says_so(monkeypatch) -> None:
    monkeypatch.setattr(_shared_slabs, "MAX_SLABS", 2)
    slabs = SharedSlabs(4096, _views)
    kept = [slabs.lend(slabs.take()) for _ in range(2)]
    with pytest.raises(RuntimeError, match="all 2 batch slabs are held by live batches"):
        slabs.take()
    del kept
    slabs.take()
    slabs.close()
