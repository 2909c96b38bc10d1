"""Running a benchmark on several real ranks: spawned processes joined in a process group on
127.0.0.1, each running the same function; every rank's return value comes back to the caller.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def run_ranks(target: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              pg_timeout_s: float = 600.0) -> list[Any]:
    """Run `target(rank, world_size, *args)` on `world_size` ranks (spawned, `backend` process
    group initialized); return their values in rank order.

    Raises:
        RuntimeError: a rank failed (its traceback is printed) or produced nothing.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="asynctron-bench-ranks-") as scratch:
        processes = [context.Process(target=_rank_main, args=(
            target, rank, world_size, port, backend, pg_timeout_s, scratch, args))
            for rank in range(world_size)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        values = []
        for rank, process in enumerate(processes):
            path = os.path.join(scratch, f"rank{rank}.pkl")
            if process.exitcode or not os.path.exists(path):
                raise RuntimeError(f"rank {rank}: expected a result, found exit code "
                                   f"{process.exitcode}; its traceback is printed above")
            with open(path, "rb") as f:
                values.append(pickle.load(f))
    return values


def _rank_main(target: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
               pg_timeout_s: float, scratch: str, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist  # in the child, after spawn

    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        value = target(rank, world_size, *args)
        with open(os.path.join(scratch, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(value, f)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()
