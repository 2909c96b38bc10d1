"""AsyncDataParallel on one rank: a module wrapper that trains in a few lines.
(Against DDP on several ranks: tests/distributed/test_comm_ranks.py.)"""

from __future__ import annotations

import torch

from asynctron.comm import AsyncDataParallel


async def test_wraps_a_module_and_ends_steps(world_one: None) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = AsyncDataParallel(net, bucket_size_bytes=1 << 20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    await model.broadcast_parameters()
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        await model.step(optimizer)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.grad is None for p in model.parameters())
    assert model.last_step is not None and model.last_step.num_all_reduces == 1
    assert list(model.state_dict()) == [f"module.{key}" for key in net.state_dict()]
    with model.no_sync():
        torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.functional.mse_loss(model(x), y).backward()
    await model.synchronize()
    model.zero_grad()
