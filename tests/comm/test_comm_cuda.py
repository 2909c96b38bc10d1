"""CUDA paths: buckets of CUDA gradients, all-reduced with NCCL (one rank per GPU; one GPU is
enough for a group of one) and gloo. Skip without CUDA."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from asynctron.comm import BucketManager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(params=["nccl", "gloo"])
def cuda_world_one(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "nccl" and not dist.is_nccl_available():
        pytest.skip("torch built without NCCL")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group(request.param, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def _net(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 8)).to("cuda", dtype)


async def test_cuda_gradients_synchronize(cuda_world_one: str) -> None:
    net, reference = _net(), _net()
    manager = BucketManager(net, bucket_size_bytes=20_000, first_bucket_size_bytes=10_000)
    assert {bucket.buffer.device.type for bucket in manager.buckets} == {"cuda"}
    for step in range(3):
        x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        net(x).square().mean().backward()
        await manager.synchronize()
        reference(x).square().mean().backward()
        for param, expected in zip(net.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param.grad, expected.grad)  # one rank: mean is itself
        manager.zero_grad()
        reference.zero_grad()


async def test_cuda_bf16_parameters_with_fp32_buffers(cuda_world_one: str) -> None:
    net = _net(torch.bfloat16)
    manager = BucketManager(net, grad_dtype=torch.float32, find_unused_parameters=True)
    net(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)).float().square().mean(
        ).backward()
    await manager.synchronize()
    for param in net.parameters():
        assert param.grad.dtype == torch.bfloat16 and param.grad.is_cuda
        assert manager.main_grad(param).dtype == torch.float32
