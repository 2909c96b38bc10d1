"""One rank of the demo: a small GPT trained data-parallel on one uvloop loop, with every part
of asynctron at work.

Per step: the next batch comes from the `AsyncLoader` (assembled by a worker process),
forward and backward run on the loop, gradients are all-reduced bucket by bucket while backward
runs (`AsyncDataParallel`), and every K steps the whole state (model, optimizer, loader position,
step) is saved asynchronously: training waits only for `task.staged`, then goes on while the
engine writes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from asynctron.comm import AsyncDataParallel
from asynctron.datasets import AsyncLoader, ByteTokenizer, GPTDatasetConfig, build_gpt_datasets
from asynctron.engine import Engine, SaveTask
from asynctron.testing import LoopWatchdog

from ._model import TinyGPT, language_model_loss

MiB = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """The demo's knobs; the defaults finish in well under two minutes on 2 cores."""

    out: str
    """Directory for the corpus, the index cache and the checkpoints."""
    num_ranks: int = 2
    """Data-parallel ranks (spawned processes on one gloo group)."""
    num_steps: int = 40
    """Steps of the uninterrupted run; the first run stops half-way, on a save."""
    save_every: int = 10
    """Save after every K-th step."""
    hidden: int = 256
    """Width of the model."""
    num_layers: int = 4
    """Decoder blocks."""
    num_heads: int = 4
    """Attention heads."""
    sequence_length: int = 64
    """Tokens per sample."""
    micro_batch_size: int = 8
    """Samples per rank per step."""
    num_documents: int = 3000
    """Documents in the generated corpus."""
    keep_last: int | None = None
    """Keep only this many newest checkpoints (None: all)."""
    seed: int = 0
    """Seed of the corpus, the model's initial weights and the data order."""

    def __post_init__(self) -> None:
        for name in ("num_ranks", "num_steps", "save_every", "hidden", "num_layers",
                     "num_heads", "sequence_length", "micro_batch_size", "num_documents"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, found {value!r}")
        if self.num_steps < 2 * self.save_every:
            raise ValueError(f"num_steps: expected at least 2 * save_every "
                             f"({2 * self.save_every}), found {self.num_steps}; the first run "
                             "must stop on a save half-way")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden: expected a multiple of num_heads ({self.num_heads}), "
                             f"found {self.hidden}")

    @property
    def stop_step(self) -> int:
        """Where the first run stops: the last save at or before half-way."""
        return self.num_steps // 2 // self.save_every * self.save_every


@dataclasses.dataclass(frozen=True, slots=True)
class RunReport:
    """One run on one rank."""

    name: str
    first_step: int
    losses: list[float]
    """This rank's loss at each step, from `first_step` on."""
    train_s: float
    data_wait_s: float
    """Time spent waiting for the next batch."""
    longest_step_s: float
    """The slowest forward + backward + synchronize + optimizer step (it runs on the loop)."""
    blocked_s: float
    """Sum over saves of request → `task.staged`: what training waited for checkpoints."""
    checkpoint_s: float
    """Sum over saves of request → committed."""
    num_saves: int
    saved_bytes: int
    worst_loop_delay_s: float
    num_params: int


def dataset(config: DemoConfig, prefix: str) -> Any:
    """The training samples every run reads, in Megatron's order (the index cache is built by
    rank 0, once)."""
    samples = config.num_steps * config.micro_batch_size * config.num_ranks
    gpt = GPTDatasetConfig(random_seed=config.seed, sequence_length=config.sequence_length,
                           blend=([prefix], None), split="100,0,0",
                           path_to_cache=os.path.join(config.out, "index-cache"),
                           tokenizer=ByteTokenizer(), create_attention_mask=False)
    train, _, _ = build_gpt_datasets(gpt, [samples, 0, 0])
    return train


async def train(config: DemoConfig, rank: int, samples: Any, name: str, *, stop_step: int,
                checkpoints: str | None, resume: bool) -> RunReport:
    """Train from step 1 (or, with `resume`, from the newest checkpoint in `checkpoints`) up to
    `stop_step`, saving to `checkpoints` after every `save_every`-th step (if given)."""
    torch.manual_seed(config.seed)
    model = TinyGPT(vocab_size=ByteTokenizer.vocab_size, sequence_length=config.sequence_length,
                    hidden=config.hidden, num_layers=config.num_layers,
                    num_heads=config.num_heads)
    parallel = AsyncDataParallel(model, bucket_size_bytes=1 * MiB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tasks: list[SaveTask] = []
    losses: list[float] = []
    blocked_s = data_wait_s = longest_step_s = 0.0
    first_step = 1
    # One job name for the first run and the resumed one: `keep_last` prunes across both.
    async with Engine(keep_last=config.keep_last, job="asynctron-demo",
                      memory_budget_bytes=256 * MiB, slab_bytes=16 * MiB) as engine:
        loader = AsyncLoader(samples, micro_batch_size=config.micro_batch_size,
                             run_blocking=engine.run_blocking, prefetch_budget=16 * MiB,
                             num_ready_batches=2, data_parallel_rank=rank,
                             data_parallel_size=config.num_ranks,
                             num_workers=1)  # one per rank: the demo's batches are small
        if resume:
            assert checkpoints is not None
            state = await engine.load(checkpoints)  # the newest commit (`latest`)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            loader.load_state_dict(state["loader"])
            first_step = state["step"] + 1
        else:
            await parallel.broadcast_parameters()
        async with loader, LoopWatchdog() as watchdog:
            batches = aiter(loader)
            started = time.perf_counter()
            for step in range(first_step, stop_step + 1):
                waited = time.perf_counter()
                batch = await anext(batches)
                computing = time.perf_counter()
                data_wait_s += computing - waited
                loss = language_model_loss(parallel, batch)
                loss.backward()
                await parallel.step(optimizer)
                longest_step_s = max(longest_step_s, time.perf_counter() - computing)
                losses.append(loss.item())
                if checkpoints is not None and step % config.save_every == 0:
                    requested = time.perf_counter()
                    task = engine.save({"model": model.state_dict(),
                                        "optimizer": optimizer.state_dict(),
                                        "loader": loader.state_dict(), "step": step},
                                       os.path.join(checkpoints, f"step_{step}"))
                    await task.staged  # the next optimizer step may now change the tensors
                    blocked_s += time.perf_counter() - requested
                    tasks.append(task)
            train_s = time.perf_counter() - started
            results = [await task for task in tasks]
    return RunReport(name=name, first_step=first_step, losses=losses, train_s=train_s,
                     data_wait_s=data_wait_s, longest_step_s=longest_step_s,
                     blocked_s=blocked_s, checkpoint_s=sum(r.total_s for r in results),
                     num_saves=len(results), saved_bytes=sum(r.nbytes for r in results),
                     worst_loop_delay_s=watchdog.report().worst_delay_s,
                     num_params=sum(p.numel() for p in model.parameters()))
