"""The demo trainer: a small model trained on one uvloop loop while it checkpoints itself.

Every K steps it requests a save, waits only for `task.staged`, and goes on training while the
write runs; at the end it loads the newest checkpoint back and compares it bit for bit with a
copy of the state taken when that save was requested.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from asynctron.engine import Engine, SaveResult, SaveTask
from asynctron.testing import LoopWatchdog

_DEMO_BATCH = 32


@dataclasses.dataclass(frozen=True, slots=True)
class DemoReport:
    """What `run_demo` measured."""

    num_steps: int
    num_params: int
    train_s: float
    """From the first step until the last step finished (saves may still be writing)."""
    longest_step_s: float
    """The slowest training step: the loop is busy for that long, so it bounds the delay."""
    saves: tuple[SaveResult, ...]
    blocked_s: float
    """Sum over saves of request -> `task.staged`: the time training waited for checkpoints."""
    worst_loop_delay_s: float
    mismatch: str | None
    """None if the newest checkpoint loaded back bit-exact, else the first difference."""


async def run_demo(out: str, *, steps: int, save_every: int, hidden: int,
                   keep_last: int | None) -> DemoReport:
    """Train a 4-layer MLP with AdamW for `steps` steps, saving to `out/step_<n>` after every
    `save_every`-th step. Training waits only for `task.staged`, then goes on while the write
    runs; the newest checkpoint is loaded back from `out` and compared with a deep copy of the
    state taken at its save request.

    Raises:
        StorageError, FileExistsError: a save failed (the other saves are cancelled).
    """
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers[:-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    last_save_step = steps - steps % save_every
    expected: dict[str, Any] = {}
    tasks: list[SaveTask] = []
    blocked_s = longest_step_s = 0.0
    async with Engine(keep_last=keep_last) as engine, LoopWatchdog() as watchdog:
        t_start = time.perf_counter()
        for step in range(1, steps + 1):
            t_step = time.perf_counter()
            inputs = torch.randn(_DEMO_BATCH, hidden, generator=data)
            targets = torch.randn(_DEMO_BATCH, hidden, generator=data)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            longest_step_s = max(longest_step_s, time.perf_counter() - t_step)
            if step % save_every == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "step": step}
                if step == last_save_step:
                    expected = copy.deepcopy(state)
                t_request = time.perf_counter()
                task = engine.save(state, os.path.join(out, f"step_{step}"))
                await task.staged  # the next optimizer step may now change the tensors
                blocked_s += time.perf_counter() - t_request
                tasks.append(task)
            await asyncio.sleep(0)  # let the engine's writes progress between steps
        train_s = time.perf_counter() - t_start
        saves = tuple([await task for task in tasks])
        loaded = await engine.load(out)
    return DemoReport(
        num_steps=steps,
        num_params=sum(p.numel() for p in model.parameters()),
        train_s=train_s,
        longest_step_s=longest_step_s,
        saves=saves,
        blocked_s=blocked_s,
        worst_loop_delay_s=watchdog.report().worst_delay_s,
        mismatch=first_difference(expected, loaded),
    )


def first_difference(expected: Any, found: Any, key: str = "") -> str | None:
    """The first place where `found` is not bit-identical to `expected`, or None.

    Any two mappings compare by their keys in order (a checkpoint loads an OrderedDict as a
    dict); tensors compare by dtype, shape and raw bytes.
    """
    where = key or "<root>"
    if isinstance(expected, Mapping) and isinstance(found, Mapping):
        if list(expected) != list(found):
            return f"key {where!r}: expected keys {list(expected)}, found {list(found)}"
        children: Sequence[tuple[Any, Any, Any]] = [
            (k, expected[k], found[k]) for k in expected]
    elif type(expected) in (list, tuple) and type(found) is type(expected):
        if len(expected) != len(found):
            return f"key {where!r}: expected {len(expected)} entries, found {len(found)}"
        children = [(i, a, b) for i, (a, b) in enumerate(zip(expected, found, strict=True))]
    elif isinstance(expected, torch.Tensor) and isinstance(found, torch.Tensor):
        if (expected.dtype, expected.shape) != (found.dtype, found.shape):
            return (f"key {where!r}: expected {expected.dtype} {list(expected.shape)}, found "
                    f"{found.dtype} {list(found.shape)}")
        if not torch.equal(_raw_bytes(expected), _raw_bytes(found)):
            return f"key {where!r}: expected the saved bytes, found different bytes"
        return None
    elif type(expected) is not type(found) or expected != found:
        return f"key {where!r}: expected {expected!r}, found {found!r}"
    else:
        return None
    for child, a, b in children:
        difference = first_difference(a, b, f"{key}.{child}" if key else str(child))
        if difference is not None:
            return difference
    return None


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
