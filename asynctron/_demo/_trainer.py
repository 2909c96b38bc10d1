"""One rank of the demo: a small GPT trained on one uvloop loop, with every part of asynctron
at work.

Per step: the next batch comes from the `AsyncLoader` (assembled by a worker process),
forward and backward run on the loop, gradients are all-reduced bucket by bucket while backward
runs (`AsyncDataParallel`; or, `sharded`, the model is FSDP2's: `fully_shard` per block and on
the root, its state DTensors from `get_state_dict`), and every K steps the whole state (model,
optimizer, loader position, step) is saved asynchronously: training waits only for
`task.staged`, then goes on while the engine writes.

The step's math (forward, backward, the optimizer) holds the loop thread, as in any async
trainer that computes on its loop: the loop's watchdog leaves it out (`excluding()`), so its
worst delay is what the rest (the loader, the all-reduces, the checkpoints) cost the loop, and
the math is timed apart, in wall time and in the loop thread's CPU time (on a machine with
fewer CPUs than the ranks and their workers need, the difference is waiting for a CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from asynctron.comm import AsyncDataParallel
from asynctron.datasets import AsyncLoader, ByteTokenizer, GPTDatasetConfig, build_gpt_datasets
from asynctron.engine import Engine, SaveResult, SaveTask, Tiers
from asynctron.errors import PeerError
from asynctron.testing import LoopWatchdog

from ._model import TinyGPT, language_model_loss

MiB = 1 << 20
logger = logging.getLogger(__name__)


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
    num_nodes: int = 2
    """Nodes of the node-loss run (0: no such run); its last node is lost mid-run."""
    ranks_per_node: int = 2
    """Ranks per node in the node-loss run, which runs `num_nodes * ranks_per_node` ranks."""
    seed: int = 0
    """Seed of the corpus, the model's initial weights and the data order."""

    def __post_init__(self) -> None:
        for name in ("num_ranks", "num_steps", "save_every", "hidden", "num_layers",
                     "num_heads", "sequence_length", "micro_batch_size", "num_documents",
                     "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, found {value!r}")
        if self.num_steps < 2 * self.save_every:
            raise ValueError(f"num_steps: expected at least 2 * save_every "
                             f"({2 * self.save_every}), found {self.num_steps}; the first run "
                             "must stop on a save half-way")
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or (
                self.num_nodes == 1 or self.num_nodes < 0):
            raise ValueError(f"num_nodes: expected 0 (no node-loss run) or an int >= 2, found "
                             f"{self.num_nodes!r}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden: expected a multiple of num_heads ({self.num_heads}), "
                             f"found {self.hidden}")

    @property
    def stop_step(self) -> int:
        """Where the first run stops: the last save at or before half-way."""
        return self.num_steps // 2 // self.save_every * self.save_every

    @property
    def lost_at_step(self) -> int:
        """In the node-loss run, the step after which the last node is lost: between two
        saves, after half-way."""
        return self.stop_step + max(1, self.save_every // 2)


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
    """The loop's worst heartbeat delay outside the steps' math."""
    num_params: int
    restored_from: tuple[str, ...] = ()
    """Where each rank's state came from, for a run resumed from the tiers."""
    restore_s: float = 0.0
    longest_math_s: float = 0.0
    """The most wall time one step's math (forward, backward, optimizer) held the loop."""
    longest_math_cpu_s: float = 0.0
    """The loop thread's CPU time in that step's math (the rest it waited for a CPU)."""


def dataset(config: DemoConfig, prefix: str, world_size: int) -> Any:
    """The training samples every run of `world_size` ranks reads, in Megatron's order (the
    index cache is built by rank 0, once)."""
    samples = config.num_steps * config.micro_batch_size * world_size
    gpt = GPTDatasetConfig(random_seed=config.seed, sequence_length=config.sequence_length,
                           blend=([prefix], None), split="100,0,0",
                           path_to_cache=os.path.join(config.out, "index-cache"),
                           tokenizer=ByteTokenizer(), create_attention_mask=False)
    train, _, _ = build_gpt_datasets(gpt, [samples, 0, 0])
    return train


class Checkpoints(Protocol):
    """Where a run saves and resumes: a directory (`Directory`) or the engine's tiers
    (`TieredCheckpoints`)."""

    def engine_options(self) -> dict[str, Any]:
        """The `Engine`'s keywords for this way of saving."""
        ...

    def save(self, engine: Engine, state: dict[str, Any], step: int) -> SaveTask:
        """Start saving `state` of `step`."""
        ...

    async def resume(self, engine: Engine, state: dict[str, Any]) -> dict[str, Any]:
        """The newest state saved: `state`'s tensors filled in place, and the saved values."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Directory:
    """Checkpoints in one directory, `step_<N>` each, `latest` naming the newest."""

    path: str
    keep_last: int | None

    def engine_options(self) -> dict[str, Any]:
        # One job name for the first run and the resumed one: `keep_last` prunes across both.
        return {"keep_last": self.keep_last, "job": "asynctron-demo"}

    def save(self, engine: Engine, state: dict[str, Any], step: int) -> SaveTask:
        return engine.save(state, os.path.join(self.path, f"step_{step}"))

    async def resume(self, engine: Engine, state: dict[str, Any]) -> dict[str, Any]:
        return await engine.load_into(state, self.path)  # the newest commit (`latest`)


@dataclasses.dataclass(frozen=True, slots=True)
class TieredCheckpoints:
    """Checkpoints in the engine's tiers: each node's local tier, a replica on the next node,
    a store; resumed from the nearest tier that verifies."""

    tiers: Tiers

    def engine_options(self) -> dict[str, Any]:
        return {"tiers": self.tiers}

    def save(self, engine: Engine, state: dict[str, Any], step: int) -> SaveTask:
        return engine.save(state, step=step)

    async def resume(self, engine: Engine, state: dict[str, Any]) -> dict[str, Any]:
        result = await engine.restore(state)
        sources = ", ".join(f"rank {r}: {s}" for r, s in enumerate(result.sources))
        logger.info("restored step %d (%s) in %.2f s", result.step, sources, result.restore_s)
        return {**result.state, "sources": result.sources, "restore_s": result.restore_s}


@dataclasses.dataclass(slots=True)
class _Progress:
    """A run's figures as it goes (a run cut short by a lost peer reports them as they are)."""

    first_step: int = 1
    losses: list[float] = dataclasses.field(default_factory=list)
    train_s: float = 0.0
    data_wait_s: float = 0.0
    longest_step_s: float = 0.0
    blocked_s: float = 0.0
    results: list[SaveResult] = dataclasses.field(default_factory=list)
    worst_loop_delay_s: float = 0.0
    restored: dict[str, Any] = dataclasses.field(default_factory=dict)
    longest_math_s: float = 0.0
    longest_math_cpu_s: float = 0.0


@dataclasses.dataclass(slots=True)
class _StepMath:
    """One step's math on the loop thread: wall time and the thread's CPU time."""

    wall_s: float = 0.0
    cpu_s: float = 0.0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wall_s += time.perf_counter() - wall
            self.cpu_s += time.thread_time() - cpu


async def train(config: DemoConfig, rank: int, samples: Any, name: str, *, stop_step: int,
                checkpoints: Checkpoints | None, resume: bool, world_size: int,
                lost_at: int | None = None, dies: bool = False,
                sharded: bool = False) -> RunReport:
    """Train from step 1 (or, with `resume`, from the newest checkpoint) up to `stop_step`,
    saving after every `save_every`-th step (if `checkpoints` are given); data-parallel, or
    with `sharded` FSDP2 over every rank.

    After step `lost_at`, every rank waits for its saves to commit (so the node lost then
    has its last checkpoint done), and a rank that `dies` is SIGKILLed, as when its node is
    lost; a rank that then finds a peer gone (`PeerError`) stops there and reports the steps
    it made, as a trainer's log would keep them. (Every rank waits at once: a rank waiting
    for a save while another is in a training collective would wait for ever, the save's
    collectives needing that rank's loop, which the collective holds.)"""
    torch.manual_seed(config.seed)
    model = TinyGPT(vocab_size=ByteTokenizer.vocab_size, sequence_length=config.sequence_length,
                    hidden=config.hidden, num_layers=config.num_layers,
                    num_heads=config.num_heads)
    progress = _Progress()
    try:
        await _run(config, rank, samples, model, progress, stop_step=stop_step,
                   checkpoints=checkpoints, resume=resume, world_size=world_size,
                   lost_at=lost_at, dies=dies, sharded=sharded)
    except PeerError as error:
        if checkpoints is None or not isinstance(checkpoints, TieredCheckpoints):
            raise
        logger.info("rank %d: a peer was lost after step %d (%s)", rank,
                    progress.first_step + len(progress.losses) - 1, error)
    results = progress.results
    return RunReport(name=name, first_step=progress.first_step, losses=progress.losses,
                     train_s=progress.train_s, data_wait_s=progress.data_wait_s,
                     longest_step_s=progress.longest_step_s, blocked_s=progress.blocked_s,
                     checkpoint_s=sum(r.total_s for r in results), num_saves=len(results),
                     saved_bytes=sum(r.nbytes for r in results),
                     worst_loop_delay_s=progress.worst_loop_delay_s,
                     num_params=sum(p.numel() for p in model.parameters()),
                     restored_from=tuple(progress.restored.get("sources", ())),
                     restore_s=progress.restored.get("restore_s", 0.0),
                     longest_math_s=progress.longest_math_s,
                     longest_math_cpu_s=progress.longest_math_cpu_s)


class _Parallel(Protocol):
    """How a run's model is trained across ranks, and its state taken and given back. A step
    ends with `await synchronize()` then `update(optimizer)` (`AsyncDataParallel.step` in two,
    so the optimizer's math is timed as the step's math)."""

    async def start(self) -> None: ...

    async def synchronize(self) -> None: ...

    def update(self, optimizer: torch.optim.Optimizer) -> None: ...

    def state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def load(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None: ...


class _DataParallel:
    """`AsyncDataParallel`: every rank a whole replica, gradients all-reduced in buckets."""

    def __init__(self, model: TinyGPT) -> None:
        self.model = model
        self.parallel = AsyncDataParallel(model, bucket_size_bytes=1 * MiB)

    async def start(self) -> None:
        await self.parallel.broadcast_parameters()

    async def synchronize(self) -> None:
        await self.parallel.synchronize()

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self.parallel.zero_grad()

    def state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": optimizer.state_dict()}

    def load(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


class _Sharded:
    """FSDP2 over every rank: `fully_shard` on each block and the root; the state DTensors
    from `get_state_dict`, given back by `set_state_dict` (as torchtitan does)."""

    def __init__(self, model: TinyGPT, world_size: int) -> None:
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model

    async def start(self) -> None:
        """Every rank built the same weights from the seed: nothing to broadcast."""

    async def synchronize(self) -> None:
        """FSDP2's reduce-scatters are done when backward returns (gloo, on the CPU)."""

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, optimizer)
        return {"model": model, "optimizer": optim}

    def load(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        set_state_dict(self.model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


async def _run(config: DemoConfig, rank: int, samples: Any, model: TinyGPT,
               progress: _Progress, *, stop_step: int, checkpoints: Checkpoints | None,
               resume: bool, world_size: int, lost_at: int | None, dies: bool,
               sharded: bool) -> None:
    parallel: _Parallel = _Sharded(model, world_size) if sharded else _DataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tasks: list[SaveTask] = []
    options = {} if checkpoints is None else checkpoints.engine_options()
    async with Engine(memory_budget_bytes=256 * MiB, slab_bytes=16 * MiB,
                      **options) as engine:
        loader = AsyncLoader(samples, micro_batch_size=config.micro_batch_size,
                             run_blocking=engine.run_blocking, prefetch_budget=16 * MiB,
                             num_ready_batches=2, data_parallel_rank=rank,
                             data_parallel_size=world_size,
                             num_workers=1)  # one per rank: the demo's batches are small
        if resume:
            assert checkpoints is not None
            _init_optimizer_state(optimizer)  # the tensors the checkpoint fills in place
            restored = await checkpoints.resume(engine, _state(parallel, optimizer, loader, 0))
            parallel.load(optimizer, restored)
            loader.load_state_dict(restored["loader"])
            torch.set_rng_state(restored["rng"])
            progress.restored = restored
            progress.first_step = restored["step"] + 1
        else:
            await parallel.start()
        async with loader, LoopWatchdog() as watchdog:
            batches = aiter(loader)
            started = time.perf_counter()
            try:
                for step in range(progress.first_step, stop_step + 1):
                    waited = time.perf_counter()
                    batch = await anext(batches)
                    computing = time.perf_counter()
                    progress.data_wait_s += computing - waited
                    math = _StepMath()
                    with watchdog.excluding(), math.timed():
                        loss = language_model_loss(model, batch)
                        loss.backward()
                    await parallel.synchronize()
                    with watchdog.excluding(), math.timed():
                        parallel.update(optimizer)
                        progress.losses.append(loss.item())
                    progress.longest_step_s = max(progress.longest_step_s,
                                                  time.perf_counter() - computing)
                    if math.wall_s > progress.longest_math_s:
                        progress.longest_math_s = math.wall_s
                        progress.longest_math_cpu_s = math.cpu_s
                    if step == lost_at:  # a node is lost, its last checkpoint long done
                        for task in tasks:
                            await task
                        if dies:
                            os.kill(os.getpid(), signal.SIGKILL)
                    if checkpoints is not None and step % config.save_every == 0:
                        requested = time.perf_counter()
                        task = checkpoints.save(engine, _state(parallel, optimizer, loader,
                                                               step), step)
                        await task.staged  # the next optimizer step may now change them
                        progress.blocked_s += time.perf_counter() - requested
                        tasks.append(task)
                progress.train_s = time.perf_counter() - started
                progress.results = [await task for task in tasks]
            finally:
                progress.worst_loop_delay_s = watchdog.report().worst_delay_s


def _state(parallel: _Parallel, optimizer: torch.optim.Optimizer, loader: AsyncLoader,
           step: int) -> dict[str, Any]:
    """Everything a resume needs, in one commit: the model, the optimizer, the loader's
    position, the RNG state (every rank's is the same: one value of the job) and the step."""
    return {**parallel.state(optimizer), "loader": loader.state_dict(),
            "rng": torch.get_rng_state(), "step": step}


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (a step of zero gradients at lr 0, as DCP's
    `_init_optim_state`), so a restore can fill them in place."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        param.grad = torch.zeros_like(param)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)
