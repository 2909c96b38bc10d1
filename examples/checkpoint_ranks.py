"""Save and load one checkpoint across ranks with asynctron, launched by torchrun:

    torchrun --nproc-per-node 2 examples/checkpoint_ranks.py OUT_DIR

Every rank holds a shard of a weight (a DTensor) and a replicated bias; each rank writes its
own files, the bias once; the checkpoint commits only if every rank succeeded. Then it is
loaded back into shards of another layout (resharding), and checked on every rank.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import uvloop
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from asynctron import Engine


async def main(out: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    state = {"model": {"weight": distribute_tensor(weight, mesh, [Shard(0)]),
                       "bias": torch.ones(16)},
             "step": 100}
    async with Engine() as engine:
        task = engine.save(state, os.path.join(out, "step_100"))
        await task.staged  # training may change the tensors from here on
        result = await task
        target = {"model": {"weight": distribute_tensor(torch.zeros(64, 16), mesh, [Shard(1)]),
                            "bias": torch.zeros(16)},
                  "step": 0}
        loaded = await engine.load(out, into=target)  # `out/latest` names step_100
    ok = (torch.equal(target["model"]["weight"].full_tensor(), weight)
          and torch.equal(target["model"]["bias"], torch.ones(16)) and loaded["step"] == 100)
    print(f"rank {dist.get_rank()}: wrote {result.files}, reloaded resharded: "
          f"{'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        uvloop.run(main(sys.argv[1]))
    finally:
        dist.destroy_process_group()
