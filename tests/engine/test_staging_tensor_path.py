"""The staging path CUDA tensors take (tensor views copied by `torch._foreach_copy_`, not
memcpy from an address), run on CPU by hiding every tensor's address: whole contiguous
tensors of every dtype and shape, pieces of one split across slabs, conjugate and strided ones,
and tensors that require grad all land exactly, and the slab's views keep no autograd graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asynctron import Engine
from asynctron.engine import _staging
from tests.conftest import assert_same


@pytest.fixture
def tensors_without_address(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _staging._address
    monkeypatch.setattr(_staging, "_address",
                        lambda payload: 0 if isinstance(payload, torch.Tensor) else real(payload))


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {f"p{i}": torch.randn(3, 5, 2, generator=generator)
                             for i in range(500)}
    state.update({
        "large": torch.randn(200, 150, generator=generator),  # 120 KB: across two slabs
        "bf16": torch.randn(31, generator=generator).to(torch.bfloat16),
        "int8": torch.arange(-50, 50, dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "complex": torch.randn(4, 4, dtype=torch.complex64, generator=generator),
        "conj": torch.randn(6, dtype=torch.complex64, generator=generator).conj(),
        "transposed": torch.randn(7, 9, generator=generator).t(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "grad": torch.randn(10, 10, generator=generator, requires_grad=True),
        "blob": b"bytes keep their memcpy path",
    })
    return state


@pytest.mark.usefixtures("tensors_without_address")
async def test_every_tensor_staged_through_views_lands_exactly(shm_path: str) -> None:
    state = _state()
    async with Engine(slab_bytes=64 << 10, memory_budget_bytes=256 << 10) as engine:
        await engine.save(state, f"{shm_path}/c")
        loaded = await engine.load(f"{shm_path}/c")
    expected = {key: value.detach().resolve_conj() if isinstance(value, torch.Tensor)
                else value for key, value in state.items()}
    assert_same(expected, loaded)
    assert state["grad"].grad_fn is None and state["grad"].grad is None
