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


async def main(out: str) -> int:
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
        loaded = await engine.load_into(target, out)  # `out/latest` names step_100
    ok = (torch.equal(target["model"]["weight"].full_tensor(), weight)
          and torch.equal(target["model"]["bias"], torch.ones(16)) and loaded["step"] == 100)
    print(f"rank {dist.get_rank()}: wrote {result.files}, reloaded resharded: "
          f"{'ok' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    dist.init_process_group("gloo")
    status = 1
    try:
        status = uvloop.run(main(sys.argv[1]))
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        dist.destroy_process_group()
    # End without finalizing the interpreter. Gloo's worker threads outlive
    # destroy_process_group (DTensor's caches keep the default group alive; only its destructor
    # joins them), and one may still be releasing the last collective (full_tensor's all-gather)
    # after this rank printed its line. Freeing that work's tensors needs the GIL, which a thread
    # cannot take once the interpreter is finalizing: CPython ends the thread, the unwind crosses
    # a noexcept destructor and the rank aborts ("terminate called without an active exception",
    # pytorch/pytorch#190489). asynctron._launch ends its ranks the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
