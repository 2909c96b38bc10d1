"""Spawning real gloo ranks for the multi-rank tests: each rank is a fresh process (spawn start
method) that joins a process group on 127.0.0.1 and runs a module-level function; its return
value (or its traceback) comes back through a file.

Unlike `torch.multiprocessing.spawn`, a rank that dies (SIGKILL) does not take the others
down: the parent waits for every rank up to a deadline, then kills what is left.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankResult:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None

    def unwrap(self) -> Any:
        assert self.error is None and self.exitcode == 0, (
            f"rank {self.rank} (exit code {self.exitcode}) failed:\n{self.error}")
        return self.value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(target: Callable[..., Any], world_size: int, out_dir: str, *args: Any,
              timeout_s: float = 120.0, pg_timeout_s: float = 30.0) -> list[RankResult]:
    """Run `target(rank, world_size, *args)` on `world_size` gloo ranks; one result per rank.

    A rank still running after `timeout_s` is killed (its exit code is then negative)."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_rank_main, name=f"test-rank-{rank}",
                                 args=(target, rank, world_size, port, out_dir, pg_timeout_s,
                                       args))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        for process in processes:
            process.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    results = []
    for rank, process in enumerate(processes):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                value, error = pickle.load(f)
        else:
            value, error = None, f"no result (exit code {process.exitcode})"
        results.append(RankResult(rank, process.exitcode, value, error))
    return results


def _rank_main(target: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str,
               pg_timeout_s: float, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist  # imported in the child, after spawn

    torch.set_num_threads(1)
    value, error = None, None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        value = target(rank, world_size, *args)
    except BaseException:
        error = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((value, error), f)
    # No destroy_process_group(): a rank whose peer died may still hold failed work; exiting
    # closes its connections either way.
    os._exit(0 if error is None else 1)
