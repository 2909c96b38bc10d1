"""The bridge from torch.distributed to asyncio: a `Work` or a `torch.futures.Future` becomes
something a coroutine awaits without blocking the loop.

Two paths, chosen per `Work`:

- future: `work.get_future()` (gloo and NCCL have one for most collectives). The thread that
  completes the work calls back, `loop.call_soon_threadsafe` wakes the awaiting coroutine, and
  no thread is held while waiting.
- waiting thread: a `Work` without a future (gloo's reduce_scatter, ...) is waited with
  `work.wait()` through the caller's `RunBlocking` door (in practice `Engine.run_blocking`).

A backend error on the way (a peer closed its connection, the group's timeout ran out) becomes
`PeerError` through `peer_error`, with the backend's error as `__cause__`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asynctron._concurrency import RunBlocking
from asynctron.errors import PeerError, PeerTimeoutError

T = TypeVar("T")


async def wait_future(future: torch.futures.Future[T]) -> T:
    """Wait for `future` on the running loop and return its value.

    The value is taken with `future.wait()` on the awaiting thread once the future is done, so
    for a CUDA future the current stream is made to wait for the work (the host does not).

    Raises:
        whatever the future raises (the backend's error, unchanged).

    Cancellation: only the wait stops; the work behind the future goes on.
    """
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: torch.futures.Future[T]) -> None:  # on the thread that completes `future`
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_set_done, waiter)

        future.add_done_callback(wake)
        await waiter
    return future.wait()


def _set_done(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # a cancelled wait leaves a cancelled waiter behind
        waiter.set_result(None)


def work_future(work: dist.Work) -> torch.futures.Future[Any] | None:
    """`work.get_future()`, or None where the backend offers no future for this work."""
    try:
        return work.get_future()
    except RuntimeError as exc:
        if "not implemented" in str(exc).lower() or "not supported" in str(exc).lower():
            return None
        raise


async def wait_work(work: dist.Work, *, run_blocking: RunBlocking | None) -> None:
    """Wait for the collective behind `work`: by its future, else by `work.wait()` through
    `run_blocking`.

    Raises:
        TypeError: the work has no future and `run_blocking` is None.
        whatever the backend raises (unchanged; see `peer_error`).

    Cancellation: a collective cannot be un-launched. On the future path only the wait stops and
    the collective goes on writing its output tensors; on the thread path the cancellation
    takes effect when `work.wait()` returns (the door finishes its call first). Either way, do
    not reuse the tensors until the work is done.
    """
    future = work_future(work)
    if future is not None:
        await wait_future(future)
        return
    if run_blocking is None:
        raise TypeError(f"work {work!r}: expected a backend with futures or a run_blocking door, "
                        "found neither; pass run_blocking=engine.run_blocking")
    await run_blocking(work.wait)


def peer_error(what: str, process_group: dist.ProcessGroup | None,
               cause: BaseException) -> PeerError:
    """The `PeerError` for a collective `what` on `process_group` that failed with `cause`: a
    `PeerTimeoutError` when `cause` is a timeout (a `TimeoutError`, or the backend's "timed
    out" error).

    The failing rank is known when the group has two ranks (it is the other one); otherwise
    it is None and the message names the group's ranks.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    ranks = [dist.get_global_rank(group, r) for r in range(world)]
    me = dist.get_rank()
    culprit = next(r for r in ranks if r != me) if world == 2 else None
    found = "rank {culprit}" if culprit is not None else f"a rank of {ranks}"
    detail = _first_sentence(str(cause)) or type(cause).__name__
    timed_out = isinstance(cause, TimeoutError) or "timed out" in str(cause).lower()
    return (PeerTimeoutError if timed_out else PeerError)(
        f"{what} on ranks {ranks}: expected every rank to take part, found "
        f"{found.format(culprit=culprit)} gone or late ({detail}); stop this rank and restart "
        "the job from its last checkpoint", rank=culprit)


def _first_sentence(message: str) -> str:
    """`[gloo/pair.cc:553] Connection closed by peer [::1]:123. This is ...` -> `Connection
    closed by peer [::1]:123`: the backend's message without its source location or advice."""
    lines = message.strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
    return text.split(". ")[0].rstrip(".")
