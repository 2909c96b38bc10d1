"""`Bucket`: parameters whose gradients sit side by side in one slice of a gradient buffer and
are all-reduced together, and `AllReduceTask`, the awaitable handle of that all-reduce.

Layout (`layout_buckets`): one contiguous buffer per (dtype, device); its buckets follow each
other in launch order, and inside a bucket the parameters follow each other in readiness order
(reverse registration). Each parameter's gradient is a view of its slice (with the parameter's
own strides when it is dense, as DDP's bucket views), so `param.grad` can *be* that view.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from asynctron._concurrency import RunBlocking
from asynctron.comm._assign import Sized, assign_buckets
from asynctron.comm._bridge import peer_error, wait_future, work_future

MiB = 1 << 20


class AllReduceTask:
    """One bucket's all-reduce in flight. `await task` returns once the bucket's slice holds
    the reduced gradients; a failed all-reduce raises `PeerError`.

    Not constructed directly; returned by `Bucket.start_all_reduce`.

    Cancellation: cancelling `await task` stops only the wait. The all-reduce cannot be
    un-launched and goes on writing into the bucket's slice: await the task again (it may be
    awaited any number of times) before reading or changing those gradients.
    """

    def __init__(self, bucket: Bucket, work: dist.Work, run_blocking: RunBlocking | None,
                 started_s: float) -> None:
        self.bucket = bucket
        self.started_s = started_s
        """`time.perf_counter()` when the all-reduce was launched."""
        self._work = work
        self._run_blocking = run_blocking
        self.future = work_future(work)
        """The backend's future for the all-reduce, or None where it offers none. No Python
        callback is attached to it until someone awaits the task: each one would wait for the
        GIL on the backend's thread."""

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        try:
            if self.future is not None:
                await wait_future(self.future)
            elif self._run_blocking is not None:
                await self._run_blocking(self._work.wait)
            else:
                raise TypeError(f"{self._what()}: expected a backend with futures or a "
                                "run_blocking door, found neither; pass "
                                "run_blocking=engine.run_blocking to the BucketManager")
        except (RuntimeError, dist.DistError) as exc:
            raise peer_error(self._what(), self.bucket.process_group, exc) from exc

    def done(self) -> bool:
        """Whether the backend has finished (or failed) the all-reduce."""
        if self.future is not None:  # it completes before the work's own flag is set
            return self.future.done()
        return self._work.is_completed()

    def result(self, timeout: float | None = None) -> None:
        """Block the calling thread until the all-reduce is done (for synchronous trainers).

        Raises:
            RuntimeError: called on a thread that runs an event loop (it would block it).
            PeerError: the all-reduce failed; `PeerTimeoutError` (also a `TimeoutError`) when
                it did not finish within `timeout` seconds.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(f"{self._what()}: result() called on an event loop thread, "
                               "where it would block the loop; use `await task` instead")
        try:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(datetime.timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as exc:
            raise peer_error(self._what(), self.bucket.process_group, exc) from exc

    def _what(self) -> str:
        return f"all-reduce of bucket {self.bucket.index} ({self.bucket.nbytes / MiB:.2f} MiB)"

    def __repr__(self) -> str:
        return f"<AllReduceTask bucket {self.bucket.index} {'done' if self.done() else 'running'}>"


class Bucket:
    """Parameters whose gradients are all-reduced together: one contiguous slice of a gradient
    buffer.

    Not constructed directly; `BucketManager.buckets` holds them, in launch order.
    """

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 buffer: torch.Tensor, views: Sequence[torch.Tensor],
                 process_group: dist.ProcessGroup | None, op: dist.ReduceOp,
                 run_blocking: RunBlocking | None) -> None:
        self.index = index
        self.params = tuple(params)
        self.names = tuple(names)
        """The parameters' names in the module (`layer.0.weight`), in layout order."""
        self.buffer = buffer
        """The bucket's slice of its gradient buffer (1-D)."""
        self.views = tuple(views)
        """Each parameter's gradient as a view of `buffer`, shaped like the parameter."""
        self.process_group = process_group
        self._op = op
        self._run_blocking = run_blocking

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def start_all_reduce(self) -> AllReduceTask:
        """Launch the all-reduce of this bucket's slice now; returns its awaitable handle.

        Every rank must launch the same buckets in the same order (`BucketManager` does).
        """
        started_s = time.perf_counter()
        try:
            work = dist.all_reduce(self.buffer, op=self._op, group=self.process_group,
                                   async_op=True)
        except (RuntimeError, dist.DistError) as exc:  # a group already broken by a peer
            raise peer_error(f"all-reduce of bucket {self.index}", self.process_group,
                             exc) from exc
        assert work is not None
        return AllReduceTask(self, work, self._run_blocking, started_s)

    def __repr__(self) -> str:
        return (f"<Bucket {self.index}: {len(self.params)} params, {self.nbytes / MiB:.2f} MiB "
                f"{self.buffer.dtype} on {self.buffer.device}>")


def layout_buckets(named_params: Sequence[tuple[str, torch.nn.Parameter]],
                   grad_dtype: torch.dtype | None, limits_bytes: Sequence[int],
                   process_group: dist.ProcessGroup | None, op: dist.ReduceOp,
                   run_blocking: RunBlocking | None) -> tuple[list[Bucket], list[torch.Tensor]]:
    """Assign `named_params` (registration order) to buckets and allocate their buffers.

    Returns the buckets in launch order and the buffers (one per (dtype, device)), zeroed.

    Memory: one buffer element per parameter element, in `grad_dtype` (or the parameter's).
    """
    def dtype_of(param: torch.nn.Parameter) -> torch.dtype:
        return grad_dtype if grad_dtype is not None else param.dtype

    order = list(range(len(named_params)))[::-1]
    items = [Sized(i, named_params[i][1].numel() * dtype_of(named_params[i][1]).itemsize,
                   (dtype_of(named_params[i][1]), named_params[i][1].device)) for i in order]
    assignment = assign_buckets(items, limits_bytes)
    keys = {item.index: item.key for item in items}
    numel_by_key: dict[Any, int] = {}
    for indices in assignment:
        key = keys[indices[0]]
        numel_by_key[key] = numel_by_key.get(key, 0) + sum(
            named_params[i][1].numel() for i in indices)
    buffers = {key: torch.zeros(numel, dtype=key[0], device=key[1])
               for key, numel in numel_by_key.items()}
    offsets = dict.fromkeys(buffers, 0)
    buckets = []
    for index, indices in enumerate(assignment):
        key = keys[indices[0]]
        start = offsets[key]
        views, cursor = [], start
        for i in indices:
            views.append(_view(buffers[key], named_params[i][1], cursor))
            cursor += named_params[i][1].numel()
        offsets[key] = cursor
        buckets.append(Bucket(index, [named_params[i][1] for i in indices],
                              [named_params[i][0] for i in indices],
                              buffers[key][start:cursor], views, process_group, op, run_blocking))
    return buckets, list(buffers.values())


def _view(buffer: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """`param`'s gradient inside `buffer` at element `offset`: with the parameter's strides when
    it is dense (what autograd gives its gradient), else row-major."""
    if _dense(param):
        return buffer.as_strided(param.size(), param.stride(), offset)
    return buffer[offset:offset + param.numel()].view(param.size())


def _dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill its span with no gap or overlap, in some dim order."""
    expected = 1
    for dim in sorted(range(tensor.dim()), key=tensor.stride):
        if tensor.size(dim) != 1:
            if tensor.stride(dim) != expected:
                return False
            expected *= tensor.size(dim)
    return True
