"""CUDA paths: D2H staging on the copy stream, H2D loads into device tensors. Skip without CUDA."""

from __future__ import annotations

import pytest
import torch

from asynctron import Engine
from tests.conftest import assert_same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SMALL = {"slab_bytes": 1 << 20, "memory_budget_bytes": 4 << 20}


def _cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "w": torch.randn(1024, 1024, device="cuda", generator=g),  # 4 MiB: spans slabs
        "bf16": torch.randn(333, device="cuda", generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 32, device="cuda", generator=g).t(),  # [32, 64], strided on device
        "cpu": torch.arange(10),
        "step": 3,
    }


async def test_cuda_round_trip_and_in_place_load(shm_path: str) -> None:
    state = _cuda_state()
    async with Engine(**SMALL) as engine:
        await engine.save(state, f"{shm_path}/c")
        loaded = await engine.load(f"{shm_path}/c")
        assert_same(state, loaded)
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
                  for k, v in state.items()}
        # the saved shape [32, 64], strided on device: filled through slabs, then H2D
        target["t"] = torch.zeros(64, 32, device="cuda").t()
        assert target["t"].shape == state["t"].shape and not target["t"].is_contiguous()
        result = await engine.load_into(target, f"{shm_path}/c")
    for key in ("w", "bf16", "t"):
        assert target[key].is_cuda and torch.equal(target[key], state[key]), key
    assert torch.equal(target["cpu"], state["cpu"])
    assert all(result[key] is target[key] for key in ("w", "bf16", "t", "cpu"))
    assert result["step"] == 3  # a value: the checkpoint's, not the target's 0


async def test_save_copies_the_state_as_of_the_request(shm_path: str) -> None:
    """The snapshot is the value after the work queued on the current stream before `save()`
    (even work the GPU has not run yet); after `staged`, the trainer may overwrite its
    tensors."""
    w = torch.zeros(4 << 20, device="cuda")  # 16 MiB: staged in waves through 4 MiB
    async with Engine(**SMALL) as engine:
        torch.cuda._sleep(100_000_000)  # tens of ms of GPU time: the fill below is still queued
        w.fill_(2.0)
        task = engine.save({"w": w}, f"{shm_path}/c")
        await task.staged
        w.fill_(1.0)
        await task
        loaded = await engine.load(f"{shm_path}/c")
    assert torch.equal(loaded["w"].cpu(), torch.full((4 << 20,), 2.0))
