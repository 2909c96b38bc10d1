"""Small models held the way large jobs hold them, for tests and benchmarks on gloo ranks (CPU):

- `fsdp`: FSDP2, `fully_shard` on every block and on the root, over all ranks;
- `hsdp`: FSDP2 on a 2-D mesh (replicate x shard): each node a replica, sharded inside it;
- `tp`: tensor parallel inside a node (`ColwiseParallel`/`RowwiseParallel` on each block's
  two linears) with FSDP2 across nodes: a 2-D (dp x tp) mesh;
- `ddp`: `DistributedDataParallel`: every tensor replicated, plain (not DTensor).

Each with AdamW; its state comes from `get_state_dict` and goes back by `set_state_dict`, as
torchtitan does. Ranks `[k * per_node, (k + 1) * per_node)` are node k: the meshes put the
replica dimension (hsdp), the data-parallel one (tp) across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from asynctron.storage.format import digest

Layout = Literal["fsdp", "hsdp", "tp", "ddp"]
LAYOUTS: tuple[Layout, ...] = ("fsdp", "hsdp", "tp", "ddp")

__all__ = ["LAYOUTS", "Block", "Job", "Layout", "build", "full_digests", "full_nbytes"]


class Block(torch.nn.Module):
    """A transformer MLP block: up, ReLU, down, LayerNorm (with a residual)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


@dataclass
class Job:
    """A model under a layout, its optimizer, and the width its inputs have."""

    layout: Layout
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    width: int

    def state(self) -> dict[str, Any]:
        """The model's and optimizer's state, as `get_state_dict` gives it."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optimizer}

    def load(self, state: dict[str, Any]) -> None:
        """Give the model and optimizer `state` back (`set_state_dict`)."""
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def train_step(self, step: int) -> float:
        """One step on inputs that depend only on `step` (the same on every rank)."""
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(8, self.width, generator=g)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.detach())

    def init_optimizer_state(self) -> None:
        """Give a fresh optimizer its state tensors (a step of zero gradients at learning rate
        0, as DCP's `_init_optim_state` does), so a restore can fill them in place."""
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for parameter in self.model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        self.optimizer.step()
        self.optimizer.zero_grad()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr


def build(layout: Layout, *, per_node: int, width: int = 64, depth: int = 2,
          seed: int = 0) -> Job:
    """`layout` over every rank of the default process group (`per_node` ranks a node)."""
    world = dist.get_world_size()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, found {layout!r}")
    if layout == "ddp":
        model = DistributedDataParallel(model)
    else:
        if layout == "fsdp":
            shard_mesh = init_device_mesh("cpu", (world,))
        elif layout == "hsdp":
            shard_mesh = init_device_mesh("cpu", (world // per_node, per_node),
                                          mesh_dim_names=("replicate", "shard"))
        else:  # tp
            mesh = init_device_mesh("cpu", (world // per_node, per_node),
                                    mesh_dim_names=("dp", "tp"))
            for block in model:
                parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                                       "down": RowwiseParallel()})
            shard_mesh = mesh["dp"]
        for block in model:
            fully_shard(block, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Job(layout, model, optimizer, width)


def full_digests(state: dict[str, Any]) -> dict[str, str]:
    """Every tensor of `state` (nested) as the digest of its whole (global) bytes, by dotted
    key: the same for one state under any layout. Collective: a DTensor is gathered."""
    found: dict[str, str] = {}

    def visit(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                visit(f"{prefix}.{key}" if prefix else str(key), value)
        elif isinstance(node, list | tuple):
            for index, value in enumerate(node):
                visit(f"{prefix}.{index}", value)
        elif isinstance(node, torch.Tensor):
            whole = node.full_tensor() if isinstance(node, DTensor) else node
            data = whole.detach().contiguous().reshape(-1).view(torch.uint8)
            found[prefix] = digest(memoryview(data.numpy())) if data.numel() else "empty"

    visit("", state)
    return found


def full_nbytes(state: dict[str, Any]) -> int:
    """The bytes of every tensor of `state` (nested), whole (a DTensor's global size)."""
    if isinstance(state, dict):
        return sum(full_nbytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(full_nbytes(value) for value in state)
    if isinstance(state, torch.Tensor):
        return state.numel() * state.dtype.itemsize
    return 0
