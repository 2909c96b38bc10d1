"""The trainers of `asynctron bench tiers`: step time saving every step through the tiers
against the same trainer without saves, each on every rank, the two in turns.

- `accelerated`: a trainer whose compute leaves the cores free, as a GPU's does: each step a
  real FSDP2 step (its gloo all-gathers and reduce-scatters, a small batch) then the step's
  compute as a sleep, the state and the step in a real job's ratio (`state_mib` per rank,
  `step_s` a step; 64 MiB and 0.5 s is harsher than a 7B model under FSDP on 64 GPUs: ~1.75
  GB per rank, 5-10 s steps);
- `cpu`: the demo's GPT under FSDP2, its compute on the cores the saves need (this VM's).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from asynctron import Engine, Tiers
from asynctron._knobs import RANKS_PER_NODE
from asynctron.bench._fsdp_job import STEP_BYTES_PER_PARAMETER
from asynctron.bench._rank_clock import Clock
from asynctron.bench._tiers_ranks import RunConfig
from asynctron.testing.layouts import build


def run(rank: int, world: int, config: RunConfig, steps: int, state_mib: float,
        step_s: float) -> dict[str, Any]:
    """Both trainers on this rank, `config.repeats` rounds after an untimed one."""
    import uvloop

    os.environ[RANKS_PER_NODE] = str(config.ranks_per_node)
    torch.set_num_threads(1)
    clock = Clock()
    uvloop.run(_accelerated(rank, world, config, clock, steps, state_mib, step_s))
    uvloop.run(_cpu(rank, world, config, clock, steps))
    return clock.result()


async def _accelerated(rank: int, world: int, config: RunConfig, clock: Clock, steps: int,
                       state_mib: float, step_s: float) -> None:
    width = 512
    parameters = state_mib * (1 << 20) * world / STEP_BYTES_PER_PARAMETER
    job = build("fsdp", per_node=config.ranks_per_node, width=width,
                depth=max(1, round(parameters / (8 * width * width))))
    job.init_optimizer_state()
    tiers = Tiers(local=f"{config.base}/accelerated/node{{node}}", replicas=1, keep_local=2)
    clock.notes["accelerated trainer"] = {"state MiB per rank": state_mib, "step s": step_s}
    for round_index in range(config.repeats + 1):
        for name, saving in (("accelerated trainer, no saves", False),
                             ("accelerated trainer, saving every step", True)):
            blocked = 0.0
            async with Engine(tiers=tiers if saving else None,
                              coordination_timeout_s=600) as engine:
                tasks = []
                await asyncio.to_thread(dist.barrier)
                started = time.perf_counter()
                for step in range(1, steps + 1):
                    job.train_step(step)  # FSDP2's collectives, on a small batch
                    await asyncio.sleep(step_s)  # the step's compute: the cores are free
                    if saving:
                        requested = time.perf_counter()
                        task = engine.save({**job.state(), "step": step}, step=step)
                        await task.staged
                        blocked += time.perf_counter() - requested
                        tasks.append(task)
                elapsed = time.perf_counter() - started
                results = [await task for task in tasks]
            if round_index > 0:
                clock.keep(name, elapsed / steps)
                if saving:
                    clock.keep("accelerated trainer, blocked per save", blocked / steps)
                    clock.keep("accelerated trainer, of which planned (a collective)",
                               sum(result.plan_s for result in results) / steps)
            if rank % config.ranks_per_node == 0:
                shutil.rmtree(tiers.local_root(rank // config.ranks_per_node),
                              ignore_errors=True)
            await asyncio.to_thread(dist.barrier)


async def _cpu(rank: int, world: int, config: RunConfig, clock: Clock, steps: int) -> None:
    from asynctron._demo import (
        DemoConfig,
        TieredCheckpoints,
        dataset,
        train,
        write_corpus,
    )

    out = f"{config.base}/cpu-trainer"
    prefix = os.path.join(out, "corpus", "corpus_text_document")
    if rank == 0:
        prefix = write_corpus(os.path.join(out, "corpus"), num_documents=1000, seed=0)
    box = [prefix]
    await asyncio.to_thread(dist.broadcast_object_list, box, 0)
    demo = DemoConfig(out=out, num_ranks=world, num_steps=steps, save_every=1, num_nodes=0)
    samples = dataset(demo, box[0], world)
    tiers = Tiers(local=f"{out}/tiers/node{{node}}", replicas=1, keep_local=2)
    for round_index in range(config.repeats + 1):
        for name, checkpoints in (("cpu trainer, no saves", None),
                                  ("cpu trainer, saving every step", TieredCheckpoints(tiers))):
            report = await train(demo, rank, samples, name, stop_step=steps,
                                 checkpoints=checkpoints, resume=False, world_size=world,
                                 sharded=True)
            if round_index > 0:
                clock.keep(name, report.train_s / len(report.losses))
                if checkpoints is not None:
                    clock.keep("cpu trainer, blocked per save",
                               report.blocked_s / max(1, report.num_saves))
            if checkpoints is not None and rank % config.ranks_per_node == 0:
                shutil.rmtree(tiers.local_root(rank // config.ranks_per_node),
                              ignore_errors=True)
            await asyncio.to_thread(dist.barrier)
