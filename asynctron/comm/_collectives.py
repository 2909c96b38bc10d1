"""`CollectiveGroup`: awaitable object collectives (all-gather, gather, scatter, broadcast,
barrier) on a dedicated gloo process group, for coordination beside training (the checkpoint
coordinator).

Objects are pickled into byte tensors; every step (sizes, then payloads) is an async tensor
collective awaited through the bridge, so no thread is held and the loop never blocks. A
collective that fails or outlives `timeout_s` raises `PeerError` on every rank that is still
alive, and breaks the group: later calls raise at once.

Peers are trusted: payloads are unpickled, as `torch.distributed.all_gather_object` does.
"""

from __future__ import annotations

import asyncio
import datetime
import pickle
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asynctron._concurrency import RunBlocking, to_its_end
from asynctron.comm._bridge import peer_error, wait_work
from asynctron.errors import PeerError

T = TypeVar("T")


def new_gloo_group(*, timeout_s: float,
                   ranks: Sequence[int] | None = None) -> dist.ProcessGroup:
    """Create a gloo process group of `ranks` (default: all) whose collectives time out after
    `timeout_s`, for coordination that must not queue behind training collectives (NCCL).

    Collective and blocking, like `dist.init_process_group`: every rank of the default group
    must call it, in the same order, at startup.
    """
    _check_timeout(timeout_s)
    group = dist.new_group(ranks=None if ranks is None else list(ranks), backend="gloo",
                           timeout=datetime.timedelta(seconds=timeout_s))
    assert group is not None
    return group


def _check_timeout(timeout_s: float) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not (
            timeout_s > 0):
        raise ValueError(f"timeout_s: expected a number of seconds > 0, found {timeout_s!r}")


class CollectiveGroup:
    """Awaitable object collectives on `process_group`.

    Every rank of the group must call the same collectives in the same order. `src`/`dst` and
    `rank` are ranks in this group.

    Args:
        process_group: the group (a dedicated gloo group from `new_gloo_group`; None: the
            default group).
        run_blocking: the blocking-call door (`engine.run_blocking`), used where the backend
            offers no future for a step.
        timeout_s: each collective must complete within this many seconds, or `PeerError`.

    Concurrency: calls run one at a time, in the order they were made (a FIFO lock), so
    concurrent tasks on one rank cannot interleave the steps of two collectives.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, *, run_blocking: RunBlocking,
                 timeout_s: float) -> None:
        _check_timeout(timeout_s)
        self.process_group = process_group
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._run_blocking = run_blocking
        self._lock = asyncio.Lock()
        self._num_calls = 0
        self._broken: tuple[str, PeerError] | None = None  # (which call, its error)

    @property
    def num_calls(self) -> int:
        """Collectives issued on this group so far (each object collective counts once)."""
        return self._num_calls

    def _global(self, group_rank: int, name: str) -> int:
        if not (isinstance(group_rank, int) and 0 <= group_rank < self.world_size):
            raise ValueError(f"{name}: expected a rank in 0..{self.world_size - 1}, found "
                             f"{group_rank!r}")
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return dist.get_global_rank(group, group_rank)

    async def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank.

        Raises:
            PeerError: a rank failed or was late (the group is then broken).
            pickle.PicklingError, TypeError: `obj` cannot be pickled (nothing was sent).

        Cancellation: a collective cannot be un-launched, and leaving it half done would
        desynchronize the ranks; so it runs to its end (at most `timeout_s`), then the
        cancellation is raised. The group stays usable.
        """
        payload = _to_bytes(obj)

        async def run() -> list[Any]:
            sizes = await self._gather_sizes(payload.numel())
            width = max(sizes)
            slots = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
            await self._wait(dist.all_gather(slots, _padded(payload, width),
                                             group=self.process_group, async_op=True))
            return [_from_bytes(slot[:size]) for slot, size in zip(slots, sizes, strict=True)]

        return await self._call("all_gather_object", run)

    async def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank `dst`; None on the others.

        Raises and Cancellation: as `all_gather_object`.
        """
        payload = _to_bytes(obj)
        dst_global = self._global(dst, "dst")

        async def run() -> list[Any] | None:
            sizes = await self._gather_sizes(payload.numel())
            width = max(sizes)
            slots = ([torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
                     if self.rank == dst else None)
            await self._wait(dist.gather(_padded(payload, width), slots, dst=dst_global,
                                         group=self.process_group, async_op=True))
            if slots is None:
                return None
            return [_from_bytes(slot[:size]) for slot, size in zip(slots, sizes, strict=True)]

        return await self._call("gather_object", run)

    async def scatter_object(self, objs: Sequence[Any] | None, *, src: int = 0) -> Any:
        """`objs[r]` from rank `src` on each rank r (the others pass None).

        Raises:
            ValueError: on `src`, `objs` is not one object per rank (nothing was sent; the
                other ranks then time out, as they would for any rank that does not call).
            Others, and Cancellation: as `all_gather_object`.
        """
        src_global = self._global(src, "src")
        payloads = None
        if self.rank == src:
            if objs is None or len(objs) != self.world_size:
                found = None if objs is None else f"{len(objs)} objects"
                raise ValueError(f"objs: expected {self.world_size} objects (one per rank) on "
                                 f"rank {src}, found {found}")
            payloads = [_to_bytes(obj) for obj in objs]

        async def run() -> Any:
            sizes = (torch.zeros(self.world_size, dtype=torch.int64) if payloads is None else
                     torch.tensor([payload.numel() for payload in payloads], dtype=torch.int64))
            await self._wait(dist.broadcast(sizes, src=src_global, group=self.process_group,
                                            async_op=True))
            width = int(sizes.max())
            mine = torch.empty(width, dtype=torch.uint8)
            slots = None if payloads is None else [_padded(p, width) for p in payloads]
            await self._wait(dist.scatter(mine, slots, src=src_global, group=self.process_group,
                                          async_op=True))
            return _from_bytes(mine[:int(sizes[self.rank])])

        return await self._call("scatter_object", run)

    async def broadcast_object(self, obj: Any = None, *, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank (the others' `obj` is ignored).

        Raises and Cancellation: as `all_gather_object`.
        """
        src_global = self._global(src, "src")
        payload = _to_bytes(obj) if self.rank == src else None

        async def run() -> Any:
            size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
            await self._wait(dist.broadcast(size, src=src_global, group=self.process_group,
                                            async_op=True))
            data = payload if payload is not None else torch.empty(int(size), dtype=torch.uint8)
            await self._wait(dist.broadcast(data, src=src_global, group=self.process_group,
                                            async_op=True))
            return obj if payload is not None else _from_bytes(data)

        return await self._call("broadcast_object", run)

    async def barrier(self) -> None:
        """Return once every rank of the group has reached its `barrier()`.

        Raises and Cancellation: as `all_gather_object`.
        """
        async def run() -> None:
            await self._wait(dist.barrier(group=self.process_group, async_op=True))

        await self._call("barrier", run)

    async def _gather_sizes(self, nbytes: int) -> list[int]:
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        await self._wait(dist.all_gather(sizes, torch.tensor([nbytes], dtype=torch.int64),
                                         group=self.process_group, async_op=True))
        return [int(size) for size in sizes]

    async def _wait(self, work: dist.Work | None) -> None:
        assert work is not None
        await wait_work(work, run_blocking=self._run_blocking)

    async def _call(self, name: str, run: Callable[[], Awaitable[T]]) -> T:
        async with self._lock:
            if self._broken is not None:
                what, error = self._broken
                raise PeerError(
                    f"collective group of {self.world_size} ranks: expected a working group for "
                    f"{name}, found it broken by an earlier failure of {what}; create a new "
                    "group or restart the job", rank=error.rank)
            self._num_calls += 1
            what = f"{name} (call {self._num_calls})"
            return await to_its_end(self._guarded(what, run))

    async def _guarded(self, what: str, run: Callable[[], Awaitable[T]]) -> T:
        scope = asyncio.timeout(self.timeout_s)
        try:
            async with scope:
                return await run()
        except TimeoutError as exc:
            if not scope.expired():  # already a PeerTimeoutError from the backend
                raise
            error = peer_error(what, self.process_group, TimeoutError(
                f"not complete within timeout_s={self.timeout_s:g}"))
            self._broken = (what, error)
            raise error from exc
        except (RuntimeError, dist.DistError) as exc:
            error = peer_error(what, self.process_group, exc)
            self._broken = (what, error)
            raise error from exc

    def __repr__(self) -> str:
        state = "broken" if self._broken is not None else f"{self._num_calls} calls"
        return (f"<CollectiveGroup rank {self.rank} of {self.world_size}, timeout "
                f"{self.timeout_s:g} s, {state}>")


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)


def _padded(payload: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(width, dtype=torch.uint8)
    out[:payload.numel()] = payload
    return out


def _from_bytes(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())
