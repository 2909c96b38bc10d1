"""Starting N local ranks: fresh processes joined in a process group on 127.0.0.1, each
running the same function; each rank's return value (or traceback) comes back to the caller.
For `asynctron demo` and the multi-rank benchmarks and tests; torchrun launches real jobs.

Ranks are forked from multiprocessing's forkserver, which imports torch and asynctron once per
calling process: a rank starts in ~0.1 s where a spawned one spent ~2.5 CPU-s importing them.
The forkserver itself is a clean process (no threads, no CUDA context); each rank takes the
caller's environment and working directory as they are at the call, as a spawned one would.

Unlike `torch.multiprocessing.spawn`, a rank that dies (SIGKILL) does not take the others down:
the caller waits for every rank up to a deadline, kills what is left, and gets every result.
The caller hosts the ranks' rendezvous (a TCPStore), as torchrun's agent does, so it outlives
every rank, and every rank has joined the process group before any runs: a rank that finishes
first and exits cannot cut off one still joining.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RankResult:
    """How one rank ended: its exit code, and its return value or traceback."""

    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        """Whether the rank raised or exited non-zero."""
        return self.error is not None or bool(self.exitcode)

    def unwrap(self) -> Any:
        """The rank's return value; AssertionError (with its traceback) if it failed."""
        assert self.error is None and self.exitcode == 0, (
            f"rank {self.rank} (exit code {self.exitcode}) failed:\n{self.error}")
        return self.value


def run_local_ranks(target: Callable[..., Any], world_size: int, *args: Any,
                    backend: str = "gloo", timeout_s: float | None = None,
                    pg_timeout_s: float = 600.0) -> list[RankResult]:
    """Run `target(rank, world_size, *args)` on `world_size` fresh ranks, with the default
    process group (`backend`) initialized; one result per rank, in rank order.

    A rank still running after `timeout_s` is killed (its exit code is then negative).
    `target` and `args` must be picklable (a module-level function).
    """
    import torch.distributed as dist

    rendezvous = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                               timeout=datetime.timedelta(seconds=pg_timeout_s),
                               wait_for_workers=False)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOADED))  # taken where the forkserver starts
    caller = _Caller(environ=dict(os.environ), cwd=os.getcwd())
    with tempfile.TemporaryDirectory(prefix="asynctron-ranks-") as scratch:
        processes = [context.Process(target=_rank_main, name=f"asynctron-rank-{rank}", args=(
            target, rank, world_size, rendezvous.port, backend, pg_timeout_s, scratch, caller,
            args))
            for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            for process in processes:
                process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        results = []
        for rank, process in enumerate(processes):
            path = os.path.join(scratch, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    value, error = pickle.load(f)
            else:
                value, error = None, f"no result (exit code {process.exitcode})"
            results.append(RankResult(rank, process.exitcode, value, error))
    return results


_PRELOADED = ("torch", "torch.distributed", "asynctron")
"""What the forkserver imports before it forks a rank (where it is the one that starts it)."""


@dataclass(frozen=True, slots=True)
class _Caller:
    """What a rank takes from its caller: the forkserver's own are from when it started."""

    environ: dict[str, str]
    cwd: str


def _rank_main(target: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
               pg_timeout_s: float, scratch: str, caller: _Caller, args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(caller.environ)
    os.chdir(caller.cwd)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    value, error = None, None
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        rendezvous = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                   timeout=timeout)
        dist.init_process_group(backend, store=rendezvous, rank=rank, world_size=world_size,
                                timeout=timeout)
        # every rank joined before any runs (and may exit): a rank still connecting its
        # process group would find its peer's connection closed
        rendezvous.set(f"asynctron/joined/{rank}", b"1")
        rendezvous.wait([f"asynctron/joined/{peer}" for peer in range(world_size)], timeout)
        value = target(rank, world_size, *args)
    except BaseException:
        error = traceback.format_exc()
    with open(os.path.join(scratch, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump((value, error), f)
    # No destroy_process_group(): a rank whose peer died may still hold failed work; exiting
    # closes its connections either way.
    os._exit(0 if error is None else 1)
