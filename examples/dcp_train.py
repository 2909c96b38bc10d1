"""A torchtitan-style training loop that checkpoints through stock torch.distributed.checkpoint,
with asynctron underneath: the only change from stock DCP is the `storage_writer=` and
`storage_reader=` arguments.

`CheckpointManager` follows torchtitan's: every `interval` steps it saves the app state
(model and optimizer through `get_state_dict`, plus the step) to `<folder>/step-<n>`, with
`dcp.async_save` (the trainer blocks only while asynctron stages the state into its warm
slabs) or `dcp.save`; before each save it waits for the previous one; at start it resumes from
the newest committed step with `dcp.load`. asynctron's writer commits atomically, so a step
directory exists only once complete: finding the newest one is a directory listing.

Run: `python examples/dcp_train.py --folder /tmp/ckpt --steps 60 --interval 20`; then run it
again with more `--steps` and it resumes. `--check-resume` trains, then resumes from the last
checkpoint in a fresh model and checks every parameter and optimizer value is restored exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import asynctron.dcp

# One process, no process group: DCP says so on every call.
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

STEP_DIR = re.compile(r"step-(\d+)")


class AppState(Stateful):
    """What a checkpoint holds, as DCP wants it: `state_dict()` for saving, and
    `load_state_dict()` to take a loaded one (torchtitan's ModelWrapper/OptimizersContainer)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.step = state_dict["step"]


class CheckpointManager:
    """Saves every `interval` steps to `<folder>/step-<n>` and resumes from the newest."""

    def __init__(self, folder: str, *, interval: int, async_mode: bool) -> None:
        self.folder = folder
        self.interval = interval
        self.async_mode = async_mode
        self._pending: Future[Any] | None = None
        self.blocked_s: list[float] = []
        """Per save, how long the training loop was blocked by it."""

    def _path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def save(self, state: AppState, *, force: bool = False) -> None:
        if not force and state.step % self.interval:
            return
        self.wait()
        started = time.perf_counter()
        writer = asynctron.dcp.StorageWriter(self._path(state.step))
        if self.async_mode:
            self._pending = dcp.async_save({"app": state}, storage_writer=writer)
        else:
            dcp.save({"app": state}, storage_writer=writer)
        self.blocked_s.append(time.perf_counter() - started)

    def wait(self) -> None:
        """Wait for the save in flight (raising its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def steps(self) -> list[int]:
        """The committed checkpoints' steps, oldest first (a failed save leaves none)."""
        if not os.path.isdir(self.folder):
            return []
        return sorted(int(match[1]) for name in os.listdir(self.folder)
                      if (match := STEP_DIR.fullmatch(name)))

    def load(self, state: AppState) -> bool:
        """Resume from the newest checkpoint; False when there is none."""
        steps = self.steps()
        if not steps:
            return False
        dcp.load({"app": state},
                 storage_reader=asynctron.dcp.StorageReader(self._path(steps[-1])))
        return True


def build(features: int, hidden: int, lr: float, seed: int) -> AppState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 1))
    return AppState(model, torch.optim.AdamW(model.parameters(), lr=lr))


def batch(step: int, size: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression batch, the same for a step however often it is replayed."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(size, features, generator=generator)
    weights = torch.linspace(-1, 1, features)
    return x, (x @ weights).unsqueeze(1) + 0.01 * torch.randn(size, 1, generator=generator)


def train(state: AppState, checkpoints: CheckpointManager, *, until: int, batch_size: int,
          features: int) -> list[float]:
    losses = []
    while state.step < until:
        x, y = batch(state.step, batch_size, features)
        loss = torch.nn.functional.mse_loss(state.model(x), y)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.step += 1
        losses.append(loss.item())
        checkpoints.save(state)
    checkpoints.wait()
    return losses


def flat_state(state: AppState) -> dict[str, torch.Tensor]:
    """Every tensor of the app state by a flat key (for comparing two runs)."""
    out = {}
    stack: list[tuple[str, Any]] = [("", state.state_dict())]
    while stack:
        prefix, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{prefix}.{key}", value) for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((f"{prefix}.{i}", value) for i, value in enumerate(node))
        elif isinstance(node, torch.Tensor):
            out[prefix] = node.detach().clone()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="where step-<n> checkpoints go")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--sync", action="store_true", help="dcp.save instead of async_save")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--check-resume", action="store_true",
                        help="after training, resume into a fresh model and compare")
    parser.add_argument("--json", help="write the run's summary here")
    args = parser.parse_args()

    state = build(args.features, args.hidden, args.lr, seed=0)
    checkpoints = CheckpointManager(args.folder, interval=args.interval,
                                    async_mode=not args.sync)
    resumed = checkpoints.load(state)
    print(f"{'resumed at' if resumed else 'starting from'} step {state.step}")
    losses = train(state, checkpoints, until=args.steps, batch_size=args.batch_size,
                   features=args.features)
    if state.step % args.interval:  # the last steps since the last checkpoint
        checkpoints.save(state, force=True)
        checkpoints.wait()
    summary: dict[str, Any] = {
        "resumed_from": state.step - len(losses) if resumed else None,
        "steps": checkpoints.steps(), "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "blocked_s": checkpoints.blocked_s, "folder_entries": sorted(os.listdir(args.folder))}
    print(f"trained to step {state.step}; loss {summary['first_loss']} -> "
          f"{summary['last_loss']}; checkpoints at steps {summary['steps']}; the loop was "
          f"blocked {sum(checkpoints.blocked_s):.3f} s by {len(checkpoints.blocked_s)} saves")
    if args.check_resume:
        fresh = build(args.features, args.hidden, args.lr, seed=1)
        CheckpointManager(args.folder, interval=args.interval, async_mode=False).load(fresh)
        expected, found = flat_state(state), flat_state(fresh)
        summary["resume_exact"] = fresh.step == state.step and expected.keys() == found.keys() \
            and all(torch.equal(expected[key], found[key]) for key in expected)
        print(f"resumed into a fresh model at step {fresh.step}: every value restored "
              f"exactly: {summary['resume_exact']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
