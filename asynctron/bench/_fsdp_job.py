"""The FSDP2 job the multi-rank store benches (`tiers`, `s3 --ranks`) save and restore: a
model's and AdamW's state of about a given size (`asynctron.testing.layouts`), and a rank's
own bytes of such a state."""

from __future__ import annotations

from typing import Any

import torch

from asynctron.testing.layouts import Job, build

STEP_BYTES_PER_PARAMETER = 12
"""An fp32 parameter, and AdamW's two moments."""


def block_shape(size_gib: float) -> tuple[int, int]:
    """The width and the depth of a stack of `Block`s whose parameters and AdamW's state take
    about `size_gib` GiB."""
    width = 1024 if size_gib >= 0.25 else 256
    parameters = size_gib * (1 << 30) / STEP_BYTES_PER_PARAMETER
    depth = max(1, round(parameters / (8 * width * width + 7 * width)))
    return width, depth


def fsdp_job(size_gib: float, per_node: int, *, seed: int = 0) -> Job:
    """An FSDP2 model (and AdamW's state) of about `size_gib` GiB of state in all."""
    width, depth = block_shape(size_gib)
    job = build("fsdp", per_node=per_node, width=width, depth=depth, seed=seed)
    job.init_optimizer_state()
    return job


def local_shards(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's bytes of every tensor of a state: its shards, by dotted key."""
    found: dict[str, torch.Tensor] = {}

    def visit(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                visit(f"{prefix}.{key}" if prefix else str(key), value)
        elif isinstance(node, torch.Tensor):
            found[prefix] = node.to_local() if hasattr(node, "to_local") else node

    visit("", state)
    return found
