"""GPU trainer benchmark (`asynctron bench cuda --mode trainer`): a GPT-like model trains on the
GPU (fp32 master weights, bf16 autocast, fused AdamW) and checkpoints model and optimizer state
every N steps, through asynctron and its peers in turn, in one process (`_savers` says how each
saves and with which settings; every one ends durable, its files fsynced).

The loop, the same for every saver (torchtitan's, with zero-overhead checkpointing): a step is
forward and backward, then the optimizer step, then `loss.item()` (the step's kernels are done,
as a trainer that logs its loss knows). Every N steps the save is requested after the step;
the trainer goes on with the next step's forward and backward and waits for the save to be
staged only before that step's optimizer step (`--wait-staged before_step`; `at_once` waits
right after the request). A save first waits for the previous one to be durable.

Per saver, after an untimed warm-up save waited for to the end, medians over the timed saves:
- blocking: what the save stalls the trainer (the request call, plus the wait for `staged`);
- staged: request -> staged, however long the trainer waited for it (the library's own clock);
- durable: request -> durable (files fsynced, checkpoint committed);
- waited for the previous save: the stall when N steps were shorter than a save;
- step time with a save in flight (steps overlapping request..durable, stalls excluded) against
  steps with none (the steps before the first save).
Targets (issue 30): asynctron's blocking <= 0.5x the best DCP zero-overhead saver's; step time
with a save in flight <= 1.02x without.

`--device cpu` runs the same code on the CPU, with one intra-op thread (a tiny model is a smoke
test of the benchmark); without `--device` and without CUDA it says so and exits 0.

Run: `asynctron bench cuda --mode trainer` (~400M parameters); `--quick` for a smoke run.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import uvloop

from asynctron._demo import TinyGPT, language_model_loss
from asynctron.bench import _peers, _results, _savers
from asynctron.bench.train import _flat_training_state

GiB = 1 << 30
#: asynctron's blocking / the best DCP zero-overhead saver's (issue 30)
BLOCKING_TARGET = 0.5
#: step time with a save in flight / without (issue 30)
STEP_TARGET = 1.02
WAITS = ("before_step", "at_once")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The GPT-like model and its batch."""

    hidden: int
    """Width; heads are 64 wide."""
    num_layers: int
    vocab_size: int
    sequence_length: int
    micro_batch_size: int

    @property
    def num_parameters(self) -> int:
        """Parameters of `TinyGPT` at this size (embeddings, blocks, final norm)."""
        h = self.hidden
        block = 12 * h * h + 13 * h  # qkv, proj and MLP weights and biases, two norms
        return (self.vocab_size + self.sequence_length) * h + self.num_layers * block + 2 * h


#: ~400M parameters (4.5 GiB of state with AdamW)
FULL_MODEL = ModelConfig(hidden=1024, num_layers=28, vocab_size=50304, sequence_length=1024,
                         micro_batch_size=8)
#: a smoke run's model (CPU-friendly)
QUICK_MODEL = ModelConfig(hidden=64, num_layers=2, vocab_size=256, sequence_length=32,
                          micro_batch_size=2)


class Trainer:
    """The model, its fused AdamW (on CUDA) and one fixed batch on `device`."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = TinyGPT(vocab_size=config.vocab_size,
                             sequence_length=config.sequence_length, hidden=config.hidden,
                             num_layers=config.num_layers,
                             num_heads=max(1, config.hidden // 64)).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4,
                                           fused=device.type == "cuda")
        shape = (config.micro_batch_size, config.sequence_length)
        tokens = torch.randint(0, config.vocab_size, shape, device=device)
        self.batch = {"tokens": tokens,
                      "position_ids": torch.arange(shape[1], device=device).expand(shape),
                      "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(shape, device=device)}

    def forward_backward(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = language_model_loss(self.model, self.batch)
        loss.backward()
        return loss

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def state(self) -> dict[str, torch.Tensor]:
        """Model and optimizer state as one flat dict (the form every saver takes)."""
        return _flat_training_state(self.model, self.optimizer)


@dataclass(frozen=True, slots=True)
class Step:
    """One step's span (perf_counter seconds) and the part of it spent waiting for a save."""

    start: float
    end: float
    stall_s: float

    @property
    def compute_s(self) -> float:
        return self.end - self.start - self.stall_s


@dataclass(slots=True)
class SaveTiming:
    """One save: when it was requested, what it stalled the trainer, when it was staged and
    durable (from the request), and the wait for the previous save before it."""

    requested: float
    blocking_s: float = 0.0
    previous_wait_s: float = 0.0
    staged_s: float = math.nan
    durable_s: float = math.nan


@dataclass(slots=True)
class Run:
    """Everything one saver's run recorded."""

    steps_alone: list[Step] = field(default_factory=list)
    steps_saving: list[Step] = field(default_factory=list)
    saves: list[SaveTiming] = field(default_factory=list)


async def train_with_saves(trainer: Trainer, saver: _savers.Saver, base: str, *,
                           steps_alone: int, save_every: int, num_saves: int,
                           wait_staged: str) -> Run:
    """`steps_alone` steps without saving, one warm-up save waited for to the end (untimed),
    then a save every `save_every` steps, `num_saves` of them, the last followed by
    `save_every` steps too; returns the record. Checkpoints are written under `base`."""
    run = Run()
    clock = time.perf_counter
    for _ in range(steps_alone):
        start = clock()
        loss = trainer.forward_backward()
        trainer.optimizer_step()
        loss.item()
        run.steps_alone.append(Step(start, clock(), 0.0))
        await asyncio.sleep(0)
    warm_up = await saver.start(trainer.state(), os.path.join(base, "warm_up"))
    await warm_up.wait_staged()
    await warm_up.wait_durable()
    handles: list[_savers.SaveHandle] = []
    pending: tuple[_savers.SaveHandle, SaveTiming] | None = None
    for index in range((num_saves + 1) * save_every):
        start, stall = clock(), 0.0
        loss = trainer.forward_backward()
        if pending is not None:  # the tensors change in the optimizer step
            waited = clock()
            await pending[0].wait_staged()
            stall = clock() - waited
            pending[1].blocking_s += stall
            pending = None
        trainer.optimizer_step()
        loss.item()
        run.steps_saving.append(Step(start, clock(), stall))
        if (index + 1) % save_every == 0 and len(handles) < num_saves:
            timing = SaveTiming(requested=clock())
            if handles and not handles[-1].done():
                await handles[-1].wait_durable()
                timing.previous_wait_s = clock() - timing.requested
            requested = clock()
            handle = await saver.start(trainer.state(), os.path.join(base, f"step_{index}"))
            timing.requested = handle.requested
            timing.blocking_s = clock() - requested
            if wait_staged == "at_once":
                await handle.wait_staged()
                timing.blocking_s = clock() - requested
            else:
                pending = (handle, timing)
            handles.append(handle)
            run.saves.append(timing)
        await asyncio.sleep(0)  # the loop's other tasks (asynctron's engine) run between steps
    for handle, timing in zip(handles, run.saves, strict=True):
        await handle.wait_durable()
        timing.staged_s, timing.durable_s = handle.staged_s, handle.durable_s
    return run


def _median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarize_run(run: Run) -> dict[str, Any]:
    """Medians over the timed saves, and the step time with a save in flight (steps that
    overlap a save's request..durable span) against the steps before any save."""
    timed = run.saves
    spans = [(s.requested, s.requested + s.durable_s) for s in timed]

    def overlaps(step: Step, span: tuple[float, float]) -> bool:
        return step.start < span[1] and step.end > span[0]

    in_flight = [s.compute_s for s in run.steps_saving if any(overlaps(s, p) for p in spans)]
    between = len(run.steps_saving) - len(in_flight)
    alone = _median([s.compute_s for s in run.steps_alone])
    saving = _median(in_flight)
    return {
        "blocking_s": _median([s.blocking_s for s in timed]),
        "staged_s": _median([s.staged_s for s in timed]),
        "durable_s": _median([s.durable_s for s in timed]),
        "previous_wait_s": _median([s.previous_wait_s for s in timed]),
        "num_saves_waited_for_previous": sum(s.previous_wait_s > 0 for s in timed),
        "step_alone_s": alone, "step_in_flight_s": saving,
        "step_ratio": saving / alone if alone > 0 else math.nan,
        "num_steps_in_flight": len(in_flight), "num_steps_between_saves": between,
        "samples": {"saves": [asdict(s) for s in run.saves],
                    "step_alone_s": [s.compute_s for s in run.steps_alone],
                    "step_in_flight_s": in_flight},
    }


def ratios(methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """asynctron's savers against the best DCP zero-overhead saver (the lowest blocking of the
    ones that ran), with the issue's targets."""
    zoc = {name: m for name, m in methods.items()
           if name in (_savers.ZOC_THREAD, _savers.ZOC_PROCESS)
           and not math.isnan(m["blocking_s"])}
    best = min(zoc, key=lambda name: zoc[name]["blocking_s"]) if zoc else None
    out: dict[str, Any] = {"best_zoc": best}
    for name in (_savers.OURS, _savers.OURS_BACKGROUND):
        ours = methods.get(name)
        if ours is None:
            continue
        out[name] = {
            "blocking_vs_best_zoc": (ours["blocking_s"] / zoc[best]["blocking_s"]
                                     if best and zoc[best]["blocking_s"] > 0 else math.nan),
            "staged_vs_best_zoc": (ours["staged_s"] / zoc[best]["staged_s"]
                                   if best and zoc[best]["staged_s"] > 0 else math.nan),
            "durable_vs_best_zoc": (ours["durable_s"] / zoc[best]["durable_s"]
                                    if best else math.nan),
            "step_ratio": ours["step_ratio"],
        }
    return out


def report(result: dict[str, Any]) -> list[str]:
    """The printed table and ratio lines."""
    lines = [f"{'method':<34}{'blocking s':>11}{'staged s':>10}{'durable s':>11}"
             f"{'prev wait s':>12}{'step ms':>9}{'in flight':>10}{'ratio':>7}"]
    for name, m in result["methods"].items():
        lines.append(f"{name:<34}{m['blocking_s']:>11.3f}{m['staged_s']:>10.3f}"
                     f"{m['durable_s']:>11.3f}{m['previous_wait_s']:>12.3f}"
                     f"{m['step_alone_s'] * 1e3:>9.1f}{m['step_in_flight_s'] * 1e3:>10.1f}"
                     f"{m['step_ratio']:>7.3f}")
    versus = result["ratios"]
    for name in (_savers.OURS, _savers.OURS_BACKGROUND):
        if name in versus:
            r = versus[name]
            lines.append(f"{name}: blocking {r['blocking_vs_best_zoc']:.2f}x "
                         f"{versus['best_zoc']} (target <= {BLOCKING_TARGET}x); step with a "
                         f"save in flight {r['step_ratio']:.3f}x without (target <= "
                         f"{STEP_TARGET}x); durable {r['durable_vs_best_zoc']:.2f}x")
    lines += [f"not run: {name}: {reason}" for name, reason in result["not_run"].items()]
    for line in lines:
        print(line, flush=True)
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynctron bench cuda --mode trainer",
                                     description=_results.description(__doc__))
    parser.add_argument("--device", default=None,
                        help="cuda (default where there is one) or cpu (a smoke run)")
    parser.add_argument("--hidden", type=int, default=FULL_MODEL.hidden)
    parser.add_argument("--layers", type=int, default=FULL_MODEL.num_layers)
    parser.add_argument("--vocab", type=int, default=FULL_MODEL.vocab_size)
    parser.add_argument("--seq", type=int, default=FULL_MODEL.sequence_length)
    parser.add_argument("--batch", type=int, default=FULL_MODEL.micro_batch_size)
    parser.add_argument("--save-every", type=int, default=10, help="steps between saves")
    parser.add_argument("--saves", type=int, default=3, help="timed saves per method")
    parser.add_argument("--steps-alone", type=int, default=20,
                        help="steps without saving before the first save")
    parser.add_argument("--wait-staged", choices=WAITS, default="before_step")
    parser.add_argument("--methods", default=",".join(_savers.NAMES),
                        help=f"comma-separated subset of {','.join(_savers.NAMES)}")
    parser.add_argument("--dcp-threads", type=int, default=4,
                        help="FileSystemWriter thread_count for DCP")
    parser.add_argument("--target", default=os.path.join(os.getcwd(), "asynctron-bench-tmp"),
                        help="directory to save into (default: on the working directory's disk)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 timed save (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Arguments, `--quick` applied and `--methods` checked."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab = (QUICK_MODEL.hidden, QUICK_MODEL.num_layers,
                                                QUICK_MODEL.vocab_size)
        args.seq, args.batch = QUICK_MODEL.sequence_length, QUICK_MODEL.micro_batch_size
        args.save_every, args.saves, args.steps_alone = 2, 1, 3
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(_savers.NAMES))
    if unknown:
        parser.error(f"--methods: expected names from {list(_savers.NAMES)}, found {unknown}")
    if args.save_every < 1 or args.saves < 1:
        parser.error(f"--save-every and --saves: expected >= 1, found {args.save_every} and "
                     f"{args.saves}")
    return args


async def run_all(args: argparse.Namespace, device: torch.device, base: str,
                  on_method: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every saver in turn on one trainer; `on_method(result so far)` after each (a run cut
    short keeps what finished)."""
    config = ModelConfig(hidden=args.hidden, num_layers=args.layers, vocab_size=args.vocab,
                         sequence_length=args.seq, micro_batch_size=args.batch)
    trainer = Trainer(config, device)
    for _ in range(3):  # kernels chosen, optimizer state made
        trainer.forward_backward().item()
        trainer.optimizer_step()
    state = trainer.state()
    nbytes = sum(t.nbytes for t in state.values())
    savers, not_run = _savers.make_savers(args.methods, nbytes, device,
                                          dcp_threads=args.dcp_threads)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": asdict(config) | {"num_parameters": config.num_parameters},
        "state": {"nbytes": nbytes, "num_tensors": len(state)},
        "config": {"save_every": args.save_every, "saves": args.saves,
                   "steps_alone": args.steps_alone, "wait_staged": args.wait_staged,
                   "dcp_threads": args.dcp_threads, "target": args.target},
        "methods": {}, "not_run": not_run, "options": {}, "ratios": {}}
    print(f"{result['device']}: {config.num_parameters / 1e6:.0f}M parameters, "
          f"{nbytes / GiB:.2f} GiB of state in {len(state)} tensors; a save every "
          f"{args.save_every} steps, {args.saves} timed", flush=True)
    del state
    for saver in savers:
        directory = os.path.join(base, f"{len(result['methods'])}")
        os.makedirs(directory)
        gc.collect()
        await saver.open()
        try:
            run = await train_with_saves(trainer, saver, directory,
                                         steps_alone=args.steps_alone,
                                         save_every=args.save_every, num_saves=args.saves,
                                         wait_staged=args.wait_staged)
        finally:
            await saver.close()
            await asyncio.to_thread(shutil.rmtree, directory, True)
        result["methods"][saver.name] = summarize_run(run)
        if isinstance(saver, _savers.DcpSaver) and saver.options:
            result["options"][saver.name] = saver.options
        result["ratios"] = ratios(result["methods"])
        m = result["methods"][saver.name]
        print(f"  {saver.name:<34} blocking {m['blocking_s']:.3f} s, durable "
              f"{m['durable_s']:.3f} s, step {m['step_alone_s'] * 1e3:.1f} ms -> "
              f"{m['step_in_flight_s'] * 1e3:.1f} ms in flight", flush=True)
        on_method(result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        print("asynctron bench cuda --mode trainer: no CUDA device; nothing to measure "
              "(--device cpu runs the same loop on the CPU)")
        return 0
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    threads = torch.get_num_threads()
    if device.type == "cpu":  # a thread pool per op spins against the savers' threads
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    started = time.time()
    base = _results.scratch_dir(f"asynctron-cuda-trainer-{os.getpid()}-", args.target)
    path = _results.results_path("cuda_trainer", args.out)

    def write(result: dict[str, Any]) -> None:
        result["meta"] = _results.run_meta(started, args, torch=torch.__version__,
                                           peers=_peers.peer_versions())
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        result = uvloop.run(run_all(args, device, base, write))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        torch.set_num_threads(threads)
    result["lines"] = report(result)
    write(result)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
