"""The demo job: generate a corpus, then on N spawned ranks train three times and compare.

1. **first**: steps 1 .. stop, saving every K steps, then stop (as if the job were preempted);
2. **resumed**: fresh model, optimizer and loader, loaded from the newest checkpoint, trained
   on to the last step (still saving);
3. **reference**: steps 1 .. last without interruption.
The resumed run must reproduce the reference's losses bit for bit, on every rank.

Then the node-loss run, on `num_nodes` "nodes" of `ranks_per_node` ranks, the model under FSDP2
(`fully_shard`: its state DTensors, each rank's shard its own), saving to tiers (each node's
local tier, a replica on the next node, a store): the last node's ranks are SIGKILLed mid-run
and its local tier deleted; the job restarts on a fresh node, restores each rank from the
nearest tier (that node's ranks from the replicas on the other node) and trains to the end,
which must repeat an uninterrupted run of the same ranks bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time

import uvloop

from asynctron._knobs import RANKS_PER_NODE
from asynctron._launch import run_local_ranks
from asynctron.engine import Tiers

from ._corpus import write_corpus
from ._trainer import (
    DemoConfig,
    Directory,
    RunReport,
    TieredCheckpoints,
    dataset,
    train,
)


@dataclasses.dataclass(frozen=True, slots=True)
class DemoReport:
    """Every run on every rank, and whether resuming reproduced the uninterrupted run."""

    config: DemoConfig
    runs: list[dict[str, RunReport]]
    """Per rank: "first", "resumed", "reference"."""
    corpus_s: float
    total_s: float
    node_loss: list[dict[str, RunReport]] = dataclasses.field(default_factory=list)
    """Per rank of the node-loss run: "resumed", "reference", and "first" for the ranks that
    survived (the lost node's logged nothing it could keep)."""

    @property
    def mismatch(self) -> str | None:
        """None if, on every rank, first + resumed losses equal the reference's bit for bit
        (in the node-loss run too); else where they first differ."""
        return _mismatch(self.runs, "") or _mismatch(self.node_loss, "node-loss run ")


def _mismatch(runs: list[dict[str, RunReport]], which: str) -> str | None:
    for rank, run in enumerate(runs):
        reference, resumed = run["reference"].losses, run["resumed"].losses
        first = run["first"].losses if "first" in run else None
        start = run["resumed"].first_step
        if first is not None and len(first) < start - 1:
            return f"{which}rank {rank}: expected steps 1-{start - 1} before the resume"
        if len(reference) != start - 1 + len(resumed):
            return (f"{which}rank {rank}: expected {len(reference)} steps, found "
                    f"{start - 1 + len(resumed)}")
        interrupted = [(step, loss) for step, loss in enumerate(first or [], start=1)
                       if step < start] + list(enumerate(resumed, start=start))
        for step, loss in interrupted:
            if loss != reference[step - 1]:
                return (f"{which}rank {rank} step {step}: expected loss "
                        f"{reference[step - 1]!r} (uninterrupted), found {loss!r} "
                        f"({'resumed' if step >= start else 'first'})")
    return None


def _rank(rank: int, world_size: int, config: DemoConfig, prefix: str) -> dict[str, RunReport]:
    samples = dataset(config, prefix, world_size)
    checkpoints = Directory(os.path.join(config.out, "checkpoints"), config.keep_last)

    async def main() -> dict[str, RunReport]:
        return {
            "first": await train(config, rank, samples, "first", stop_step=config.stop_step,
                                 checkpoints=checkpoints, resume=False,
                                 world_size=world_size),
            "resumed": await train(config, rank, samples, "resumed",
                                   stop_step=config.num_steps, checkpoints=checkpoints,
                                   resume=True, world_size=world_size),
            "reference": await train(config, rank, samples, "reference",
                                     stop_step=config.num_steps, checkpoints=None,
                                     resume=False, world_size=world_size),
        }

    return uvloop.run(main())


def tiers_of(config: DemoConfig) -> Tiers:
    """The node-loss run's tiers: a local tier per node under `out/tiers`, one replica, and a
    store (a directory standing for an object store) every other save."""
    root = os.path.join(config.out, "tiers")
    return Tiers(local=os.path.join(root, "node{node}"), store=os.path.join(root, "store"),
                 replicas=1, store_every=2, keep_local=2)


def _tiered_rank(rank: int, world_size: int, config: DemoConfig, prefix: str,
                 phase: str) -> dict[str, RunReport]:
    """One rank of the node-loss run: "interrupted" (the last node's ranks die after
    `lost_at_step`; the others stop when they find them gone), or "resumed" (from the tiers,
    then the uninterrupted reference)."""
    os.environ[RANKS_PER_NODE] = str(config.ranks_per_node)
    if phase == "interrupted":  # the loss is the point: the survivors' PeerErrors are expected
        logging.getLogger("asynctron").setLevel(logging.CRITICAL)
    samples = dataset(config, prefix, world_size)
    checkpoints = TieredCheckpoints(tiers_of(config))
    last_node = rank // config.ranks_per_node == config.num_nodes - 1

    async def main() -> dict[str, RunReport]:
        if phase == "interrupted":
            return {"first": await train(
                config, rank, samples, "first", stop_step=config.num_steps,
                checkpoints=checkpoints, resume=False, world_size=world_size,
                lost_at=config.lost_at_step, dies=last_node, sharded=True)}
        return {
            "resumed": await train(config, rank, samples, "resumed",
                                   stop_step=config.num_steps, checkpoints=checkpoints,
                                   resume=True, world_size=world_size, sharded=True),
            "reference": await train(config, rank, samples, "reference",
                                     stop_step=config.num_steps, checkpoints=None,
                                     resume=False, world_size=world_size, sharded=True),
        }

    return uvloop.run(main())


def _node_loss(config: DemoConfig, prefix: str) -> list[dict[str, RunReport]]:
    """The node-loss run: interrupted by the loss of the last node, restarted on a fresh one
    (its local tier empty), resumed from the tiers."""
    world = config.num_nodes * config.ranks_per_node
    interrupted = run_local_ranks(_tiered_rank, world, config, prefix, "interrupted",
                                  timeout_s=1800)
    lost = tiers_of(config).local_root(config.num_nodes - 1)
    shutil.rmtree(lost)  # its disk went with it; the replacement node starts empty
    resumed = [r.unwrap() for r in run_local_ranks(_tiered_rank, world, config, prefix,
                                                   "resumed", timeout_s=1800)]
    for result, runs in zip(interrupted, resumed, strict=True):
        if result.error is None and result.exitcode == 0:
            runs.update(result.value)  # a surviving rank's losses before the loss
    return resumed


def run_demo(config: DemoConfig) -> DemoReport:
    """Run the demo job; `config.out` must be new or empty.

    Raises:
        AssertionError: a rank failed (its traceback is in the message).
    """
    started = time.perf_counter()
    prefix = write_corpus(os.path.join(config.out, "corpus"),
                          num_documents=config.num_documents, seed=config.seed)
    corpus_s = time.perf_counter() - started
    results = run_local_ranks(_rank, config.num_ranks, config, prefix, timeout_s=1800)
    runs = [r.unwrap() for r in results]
    node_loss = _node_loss(config, prefix) if config.num_nodes else []
    return DemoReport(config=config, runs=runs, corpus_s=corpus_s,
                      total_s=time.perf_counter() - started, node_loss=node_loss)
