"""Checkpoints inside a busy trainer: asynctron against DCP `async_save` (thread and process
modes) and Megatron's async writer, in one process, while a trainer keeps working.

Trainers:
- `idle`: none (the reference for every method's blocking and total time);
- `python`: a thread spinning pure Python, holding the GIL (as a GPU trainer's dispatch thread
  does);
- `torch`: a thread running 1-thread CPU matmuls (releases the GIL, takes a core);
- `gpt`: the demo's small GPT training on the event loop itself (an async trainer), saving
  every few steps and going on once the save is staged.
The event loop runs on the main thread; every method is started there. Per method and trainer,
medians of the repeats: blocking (until the trainer may change its tensors: `await
task.staged`, `async_save` returning, Megatron's fork), total (until durable), and the
trainer's work retained while the save runs (its rate during the save / its rate in the
second before). For `gpt`: step time while a save is in flight / without.

torch runs with one intra-op thread (the trainers and DCP's copies alike), so the 2-core
machine has one core for the trainer and one for checkpointing.

Run: `asynctron bench train`; `--quick` for a smoke run.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import uvloop

from asynctron import Engine
from asynctron._demo import TinyGPT, language_model_loss
from asynctron.bench import _baselines, _peers, _results
from asynctron.bench._rounds import round_order
from asynctron.bench._trainers import TrainerThread
from asynctron.testing import LoopWatchdog

GiB = 1 << 30
MiB = 1 << 20
OURS = "asynctron"
TRAINERS = ("idle", "python", "torch", "gpt")
#: The loop's heartbeat: every wake-up takes the GIL from the other threads, so not 1 ms.
HEARTBEAT_S = 0.005


@dataclass
class Save:
    """One save in flight, as the harness sees it: `staged` awaits the point the trainer may
    change its tensors; `done` awaits durability."""

    staged: Callable[[], Awaitable[None]]
    done: Callable[[], Awaitable[None]]


class Method:
    """How one library saves: `start(state, path)` on the loop thread (its blocking part runs
    there, as a trainer would call it), returning the `Save`."""

    name: str

    async def start(self, state: dict[str, Any], path: str) -> Save:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class Asynctron(Method):
    """A warm engine, kept across saves as a trainer keeps it; `worker_nice_increment=0`
    measures the executor's threads at the trainer's own priority (the default is +10)."""

    def __init__(self, *, worker_nice_increment: int = 10) -> None:
        self.name = OURS if worker_nice_increment == 10 else (
            f"{OURS} (workers at nice +{worker_nice_increment})")
        self.engine = Engine(memory_budget_bytes=2 * GiB + 512 * MiB,
                             worker_nice_increment=worker_nice_increment)

    async def open(self) -> None:
        await self.engine.start()
        await self.engine.prefault_staging()

    async def start(self, state: dict[str, Any], path: str) -> Save:
        task = self.engine.save(state, path)

        async def staged() -> None:
            await task.staged

        async def done() -> None:
            await task

        return Save(staged, done)

    async def close(self) -> None:
        await self.engine.aclose()


class DcpAsync(Method):
    """`dcp.async_save` with a persistent stager (its best settings), or DCP's default (a
    fresh stager per call, fresh memory every save)."""

    def __init__(self, process: bool, *, persistent_stager: bool = True) -> None:
        self.name = f"dcp async_save ({'process' if process else 'thread'}" + (
            ")" if persistent_stager else ", default stager)")
        self._saver = _peers.DcpAsyncSaver(process=process,
                                           persistent_stager=persistent_stager)

    async def start(self, state: dict[str, Any], path: str) -> Save:
        future = self._saver.start(state, path)  # stages on the caller's thread

        async def staged() -> None:
            return None

        async def done() -> None:
            await asyncio.wrap_future(future)

        return Save(staged, done)

    async def close(self) -> None:
        self._saver.close()


class MegatronAsync(Method):
    name = "megatron FileSystemWriterAsync"

    async def start(self, state: dict[str, Any], path: str) -> Save:
        save = _peers.start_megatron_async(state, path)  # plans and forks on the caller

        async def staged() -> None:
            return None

        async def done() -> None:
            while not save.done():
                await asyncio.sleep(0.005)
            save.finish()

        return Save(staged, done)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def _timed_save(method: Method, state: dict[str, Any], path: str
                      ) -> tuple[float, float]:
    """(blocking, total) seconds of one save."""
    start = time.perf_counter()
    save = await method.start(state, path)
    await save.staged()
    staged = time.perf_counter()
    await save.done()
    return staged - start, time.perf_counter() - start


async def run_thread_trainer(kind: str, methods: list[Method], state: dict[str, Any],
                             base: str, repeats: int, rate_window_s: float
                             ) -> dict[str, dict[str, list[float]]]:
    """Saves while a trainer thread works (or none, for `idle`), methods taking turns."""
    trainer = None if kind == "idle" else TrainerThread(kind)
    if trainer is not None:
        trainer.start()
    samples: dict[str, dict[str, list[float]]] = {m.name: {} for m in methods}
    try:
        for round_index in range(repeats + 1):  # round 0 warms every method
            for method in round_order(methods, round_index):
                path = os.path.join(base, f"{kind}-{round_index}-{len(method.name)}")
                gc.collect()
                async with LoopWatchdog(HEARTBEAT_S):  # in both windows: its cost cancels out
                    before = _rate_probe(trainer)
                    await asyncio.sleep(rate_window_s)
                    alone = _rate_probe(trainer)
                async with LoopWatchdog(HEARTBEAT_S) as dog:
                    blocking, total = await _timed_save(method, state, path)
                during = _rate_probe(trainer)
                await asyncio.to_thread(shutil.rmtree, path, True)
                if round_index == 0:
                    continue
                record = samples[method.name]
                record.setdefault("blocking_s", []).append(blocking)
                record.setdefault("total_s", []).append(total)
                record.setdefault("loop_worst_delay_s", []).append(dog.report().worst_delay_s)
                if trainer is not None:
                    rate_alone = (alone[0] - before[0]) / (alone[1] - before[1])
                    rate_during = (during[0] - alone[0]) / (during[1] - alone[1])
                    record.setdefault("retained", []).append(rate_during / rate_alone)
                print(f"  {kind:<7} round {round_index} {method.name:<32} blocking "
                      f"{blocking:7.3f} s  total {total:7.3f} s"
                      + (f"  retained {record['retained'][-1]:.0%}" if trainer else ""),
                      flush=True)
    finally:
        if trainer is not None:
            trainer.stop()
    return samples


def _rate_probe(trainer: TrainerThread | None) -> tuple[int, float]:
    return (trainer.count if trainer is not None else 0), time.perf_counter()


async def run_gpt_trainer(methods: list[Method], base: str, *, num_steps: int,
                          save_every: int, hidden: int, num_layers: int
                          ) -> dict[str, dict[str, list[float]]]:
    """The demo's small GPT trains on the loop, giving it one turn between steps; every
    `save_every` steps the method saves model and optimizer state; training goes on once the
    save is staged (and, as in torchtitan, a save first waits for the previous one: that wait
    is blocking too). Step times while saving are compared with the same steps just before,
    without saving."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, sequence_length=64, hidden=hidden, num_layers=num_layers,
                    num_heads=hidden // 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (4, 64))
    batch = {"tokens": tokens, "position_ids": torch.arange(64).expand(4, 64),
             "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(4, 64)}

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        language_model_loss(model, batch).backward()
        optimizer.step()

    for _ in range(3):  # optimizer state exists from here on
        step()
    samples: dict[str, dict[str, list[float]]] = {}
    for method in methods:
        record: dict[str, list[float]] = {}
        for _ in range(2 * save_every):  # the same steps without saving, just before
            started = time.perf_counter()
            step()
            record.setdefault("step_alone_s", []).append(time.perf_counter() - started)
            await asyncio.sleep(0)
        in_flight: asyncio.Task[None] | None = None
        for index in range(num_steps):
            started = time.perf_counter()
            step()
            if index >= save_every:  # the first period warms the method
                record.setdefault("step_saving_s", []).append(time.perf_counter() - started)
            if (index + 1) % save_every == 0:
                path = os.path.join(base, f"gpt-{index}-{len(method.name)}")
                state = _flat_training_state(model, optimizer)
                started = time.perf_counter()
                if in_flight is not None:  # as torchtitan: the previous save must finish first
                    await in_flight
                save = await method.start(state, path)
                await save.staged()
                if index >= save_every:
                    record.setdefault("blocking_s", []).append(time.perf_counter() - started)
                in_flight = asyncio.ensure_future(_finish(save, path, started, record,
                                                          index >= save_every))
            await asyncio.sleep(0)  # the loop's other tasks run between steps
        if in_flight is not None:
            await in_flight
        samples[method.name] = record
        alone, saving = _median(record["step_alone_s"]), _median(record["step_saving_s"])
        print(f"  gpt     {method.name:<32} blocking {_median(record['blocking_s']):7.3f} s  "
              f"step {alone * 1e3:.1f} ms alone, {saving * 1e3:.1f} ms while saving every "
              f"{save_every} steps ({saving / alone:.2f}x)", flush=True)
    return samples


def _flat_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                         ) -> dict[str, torch.Tensor]:
    """Model and optimizer state as one flat dict of tensors, the form every method takes
    (Megatron's writer takes flat string keys only)."""
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    for name, parameter in model.named_parameters():
        for key, value in optimizer.state[parameter].items():
            state[f"optim.{name}.{key}"] = value
    return state


async def _finish(save: Save, path: str, started: float, record: dict[str, list[float]],
                  keep: bool) -> None:
    await save.done()
    if keep:
        record.setdefault("total_s", []).append(time.perf_counter() - started)
    await asyncio.to_thread(shutil.rmtree, path, True)


def summarize(samples: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    """Medians per trainer and method, and the issue's ratios."""
    out: dict[str, Any] = {}
    for kind, by_method in samples.items():
        out[kind] = {name: {key: _median(values) for key, values in record.items()}
                     | {"samples": record} for name, record in by_method.items()}
    idle = out.get("idle", {}).get(OURS, {})
    for kind in ("python", "torch"):
        ours = out.get(kind, {}).get(OURS)
        if ours is None or not idle:
            continue
        ours["blocking_vs_idle"] = ours["blocking_s"] / idle["blocking_s"]
        ours["blocking_vs"] = {name: ours["blocking_s"] / m["blocking_s"]
                               for name, m in out[kind].items()
                               if name.startswith("dcp async_save")}
    return out


def report(summary: dict[str, Any]) -> list[str]:
    lines = []
    for kind, by_method in summary.items():
        lines.append(f"\n== trainer: {kind} ==")
        if kind == "gpt":
            lines.append(f"{'method':<34}{'blocking s':>11}{'total s':>9}{'step ms alone':>15}"
                         f"{'saving':>9}{'ratio':>8}")
            for name, m in by_method.items():
                ratio = m["step_saving_s"] / m["step_alone_s"]
                lines.append(f"{name:<34}{m['blocking_s']:>11.3f}{m['total_s']:>9.3f}"
                             f"{m['step_alone_s'] * 1e3:>15.1f}{m['step_saving_s'] * 1e3:>9.1f}"
                             f"{ratio:>8.2f}")
            continue
        lines.append(f"{'method':<34}{'blocking s':>11}{'total s':>9}{'retained':>10}"
                     f"{'loop ms':>9}")
        for name, m in sorted(by_method.items(), key=lambda kv: kv[1]["blocking_s"]):
            retained = f"{m['retained']:.0%}" if "retained" in m else "-"
            lines.append(f"{name:<34}{m['blocking_s']:>11.3f}{m['total_s']:>9.3f}"
                         f"{retained:>10}{m['loop_worst_delay_s'] * 1e3:>9.1f}")
        ours = by_method.get(OURS, {})
        if "blocking_vs_idle" in ours:
            versus = "; ".join(f"{ratio:.2f}x {name}" for name, ratio in
                               ours["blocking_vs"].items())
            lines.append(f"asynctron blocking: {ours['blocking_vs_idle']:.2f}x its idle "
                         f"blocking (target <= 3x); {versus} (target <= 0.5x); trainer kept "
                         f"{ours['retained']:.0%} (target >= 90%)")
    for line in lines:
        print(line)
    return lines


async def main_async(args: argparse.Namespace, base: str) -> dict[str, Any]:
    state = _baselines.make_state_dict(int(args.size_gib * GiB), seed=1)
    ours, ours_nice0 = Asynctron(), Asynctron(worker_nice_increment=0)
    await ours.open()
    await ours_nice0.open()
    methods: list[Method] = [ours, ours_nice0, DcpAsync(process=False), DcpAsync(process=True),
                             DcpAsync(process=False, persistent_stager=False)]
    reason = _peers.megatron_available() if not args.skip_megatron else "--skip-megatron"
    if reason is None:
        methods.append(MegatronAsync())
    samples: dict[str, Any] = {}
    try:
        for kind in args.trainers.split(","):
            if kind == "gpt":
                samples[kind] = await run_gpt_trainer(
                    methods, base, num_steps=args.gpt_steps, save_every=args.gpt_save_every,
                    hidden=args.gpt_hidden, num_layers=args.gpt_layers)
            else:
                samples[kind] = await run_thread_trainer(kind, methods, state, base,
                                                         args.repeats, 0.05 if args.quick else 1.0)
    finally:
        for method in methods:
            await method.close()
    summary = summarize(samples)
    summary["notes"] = {"megatron": "run" if reason is None else f"not run: {reason}"}
    summary["state"] = {"nbytes": sum(t.nbytes for t in state.values()),
                        "num_tensors": len(state)}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench train",
                                     description=_results.description(__doc__))
    parser.add_argument("--size-gib", type=float, default=1.0, help="state dict size")
    parser.add_argument("--target", default="/dev/shm", help="directory to save into")
    parser.add_argument("--trainers", default=",".join(TRAINERS),
                        help=f"comma-separated subset of {','.join(TRAINERS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpt-steps", type=int, default=60)
    parser.add_argument("--gpt-save-every", type=int, default=5)
    parser.add_argument("--gpt-hidden", type=int, default=384)
    parser.add_argument("--gpt-layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    parser.add_argument("--skip-megatron", action="store_true",
                        help="do not run Megatron's writer even where megatron-core imports")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.repeats = 0.02, 1
        args.gpt_steps, args.gpt_save_every, args.gpt_hidden, args.gpt_layers = 6, 2, 64, 2
    unknown = sorted(set(args.trainers.split(",")) - set(TRAINERS))
    if unknown:
        parser.error(f"--trainers: expected names from {list(TRAINERS)}, found {unknown}")
    torch.set_num_threads(1)
    started = time.time()
    warmed = 0 if args.quick else _baselines.warm_guest_memory()
    base = _results.scratch_dir(f"asynctron-bench-{os.getpid()}-", args.target)
    try:
        summary = uvloop.run(main_async(args, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary["lines"] = report({k: v for k, v in summary.items() if k in TRAINERS})
    summary["meta"] = _results.run_meta(
        started, args, memory_bytes=psutil.virtual_memory().total, peers=_peers.peer_versions(),
        warmed_guest_memory_bytes=warmed, torch_threads=torch.get_num_threads())
    _results.write_results("train", summary, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
