"""The demo job: generate a corpus, then on N spawned ranks train three times and compare.

1. **first**: steps 1 .. stop, saving every K steps, then stop (as if the job were preempted);
2. **resumed**: fresh model, optimizer and loader, loaded from the newest checkpoint, trained
   on to the last step (still saving);
3. **reference**: steps 1 .. last without interruption.
The resumed run must reproduce the reference's losses bit for bit, on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import time

import uvloop

from asynctron._launch import run_local_ranks

from ._corpus import write_corpus
from ._trainer import DemoConfig, RunReport, dataset, train


@dataclasses.dataclass(frozen=True, slots=True)
class DemoReport:
    """Every run on every rank, and whether resuming reproduced the uninterrupted run."""

    config: DemoConfig
    runs: list[dict[str, RunReport]]
    """Per rank: "first", "resumed", "reference"."""
    corpus_s: float
    total_s: float

    @property
    def mismatch(self) -> str | None:
        """None if, on every rank, first + resumed losses equal the reference's bit for bit;
        else where they first differ."""
        for rank, runs in enumerate(self.runs):
            interrupted = runs["first"].losses + runs["resumed"].losses
            reference = runs["reference"].losses
            if len(interrupted) != len(reference):
                return (f"rank {rank}: expected {len(reference)} steps, found "
                        f"{len(interrupted)}")
            for step, (a, b) in enumerate(zip(interrupted, reference, strict=True), start=1):
                if a != b:
                    return (f"rank {rank} step {step}: expected loss {b!r} (uninterrupted), "
                            f"found {a!r} (resumed)")
        return None


def _rank(rank: int, world_size: int, config: DemoConfig, prefix: str) -> dict[str, RunReport]:
    samples = dataset(config, prefix)
    checkpoints = os.path.join(config.out, "checkpoints")

    async def main() -> dict[str, RunReport]:
        return {
            "first": await train(config, rank, samples, "first", stop_step=config.stop_step,
                                 checkpoints=checkpoints, resume=False),
            "resumed": await train(config, rank, samples, "resumed",
                                   stop_step=config.num_steps, checkpoints=checkpoints,
                                   resume=True),
            "reference": await train(config, rank, samples, "reference",
                                     stop_step=config.num_steps, checkpoints=None,
                                     resume=False),
        }

    return uvloop.run(main())


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
    return DemoReport(config=config, runs=[r.unwrap() for r in results], corpus_s=corpus_s,
                      total_s=time.perf_counter() - started)
