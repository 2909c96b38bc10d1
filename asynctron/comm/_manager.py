"""`BucketManager`: a model's gradients gathered into buckets whose all-reduces launch while
backward is still running, and awaited on the loop before the optimizer step.

One step, as PyTorch DDP's reducer does it (torch/csrc/distributed/c10d/reducer.cpp):

1. backward: a hook before each parameter's gradient accumulator refuses a gradient that would
   land on a bucket under reduction (or on a synchronized gradient nobody reset); a hook after
   it puts the gradient into the parameter's view of its bucket (`param.grad` then *is* that
   view, or the gradient is added into an fp32 buffer), divided by the world size, and marks
   the parameter ready;
2. a bucket whose parameters are all ready launches its all-reduce, but only after every
   bucket before it, so buckets launch in the same order on every rank;
3. the end of backward (an autograd callback) checks that every bucket launched: a parameter
   that got no gradient is an error, or, with `find_unused_parameters`, is ready with zeros;
   then one small all-reduce tells which parameters no rank used (their `.grad` is left alone);
4. `await manager.synchronize()`: waits for the all-reduces on the loop, then hands the
   averaged gradients out in `param.grad`;
5. `manager.zero_grad()` (or `optimizer.zero_grad()`, which sets `.grad` to None) resets the
   step; a gradient that arrives while the synchronized one is still in place is an error.

Under `no_sync()` backward only accumulates (into the buckets), for gradient accumulation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypedDict, Unpack

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from asynctron._concurrency import RunBlocking
from asynctron._config import resolve_config
from asynctron.comm._bridge import peer_error, wait_future, wait_work
from asynctron.comm._bucket import AllReduceTask, MiB, layout_buckets
from asynctron.errors import BusyError


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketConfig:
    """How a model's gradients are bucketed and reduced, validated at construction."""

    bucket_size_bytes: int = 25 * MiB
    """Bucket cap in bytes (DDP's `bucket_cap_mb`, 25 MiB by default, times 2**20): a bucket
    closes as soon as its gradients reach this size."""
    first_bucket_size_bytes: int = 1 * MiB
    """Cap of the first bucket (the gradients ready first), so that the first all-reduce
    starts early; DDP's default is 1 MiB too. Values above `bucket_size_bytes` act as it."""
    find_unused_parameters: bool = False
    """A parameter that gets no gradient in a step is ready with zeros (one more small
    all-reduce per step tells which parameters no rank used; their `.grad` is left alone).
    False: such a parameter is an error at the end of backward."""
    grad_dtype: torch.dtype | None = None
    """dtype of the gradient buffers and of the all-reduce: None keeps each parameter's dtype
    (`param.grad` is then a view of its bucket); `torch.float32` accumulates and reduces
    bf16/fp16 gradients in fp32 and hands out a copy in the parameter's dtype."""

    def __post_init__(self) -> None:
        for name in ("bucket_size_bytes", "first_bucket_size_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int of bytes >= 1, found {value!r}")
        if not isinstance(self.find_unused_parameters, bool):
            raise ValueError(f"find_unused_parameters: expected a bool, found "
                             f"{self.find_unused_parameters!r}")
        if self.grad_dtype is not None and not (isinstance(self.grad_dtype, torch.dtype)
                                                and self.grad_dtype.is_floating_point):
            raise ValueError(f"grad_dtype: expected None or a floating torch.dtype, found "
                             f"{self.grad_dtype!r}")

    def limits_bytes(self) -> list[int]:
        return [min(self.first_bucket_size_bytes, self.bucket_size_bytes),
                self.bucket_size_bytes]


class BucketOptions(TypedDict, total=False):
    """`BucketConfig`'s fields as keywords: `BucketManager(model, bucket_size_bytes=...)` is
    `BucketManager(model, config=BucketConfig(bucket_size_bytes=...))`."""

    bucket_size_bytes: int
    first_bucket_size_bytes: int
    find_unused_parameters: bool
    grad_dtype: torch.dtype | None


@dataclass(frozen=True, slots=True)
class StepTimings:
    """Where the communication of the last synchronized step went."""

    num_all_reduces: int
    """All-reduces launched: one per bucket, plus one with `find_unused_parameters`."""
    reduce_s: float
    """From the first all-reduce's launch until `synchronize()` had them all."""
    exposed_s: float
    """From the last gradient hook until `synchronize()` had every all-reduce: the
    communication backward did not hide."""


class _Slot:
    """One parameter's place and per-step state."""

    __slots__ = ("bucket", "contributed", "guard", "handed_out", "name", "param", "ready",
                 "same_dtype", "used", "view")

    def __init__(self, param: torch.nn.Parameter, name: str, bucket: int,
                 view: torch.Tensor) -> None:
        self.param = param
        self.name = name
        self.bucket = bucket
        self.view = view
        self.same_dtype = view.dtype == param.dtype
        self.ready = False  # marked ready in the step now open
        self.used = False  # got a gradient since the last reset (no_sync backwards included)
        self.contributed = False  # the view holds this window's gradient (fp32-buffer case)
        self.handed_out: weakref.ref[torch.Tensor] | None = None  # the synchronized .grad
        self.guard: RemovableHandle | None = None  # the pre-hook, while a gradient may not come

    def drop_guard(self) -> None:
        if self.guard is not None:
            self.guard.remove()
            self.guard = None


class BucketManager:
    """Buckets a module's gradients and all-reduces them while backward runs.

    `BucketManager(model, bucket_size_bytes=25 * 2**20)`; then per step: `loss.backward()`,
    `await manager.synchronize()` (the averaged gradients are then in each `param.grad`),
    `optimizer.step()`, `manager.zero_grad()`.

    Args:
        module: the model; its parameters that require grad are bucketed, in reverse
            registration order. Every rank must build the same model.
        config: a `BucketConfig`; or its fields as keywords (`bucket_size_bytes=...`), not
            both.
        process_group: the group to average over (default: the default group).
        run_blocking: the blocking-call door (`engine.run_blocking`), needed only for a backend
            whose all-reduce has no future (gloo and NCCL have one).

    Raises:
        ValueError: a bad config field, or a module with no parameter that requires grad.
        TypeError: both `config` and keyword fields.
        RuntimeError: torch.distributed is not initialized.

    Concurrency: gradient hooks may run on autograd's threads (one per CUDA device); the
    manager's state is guarded by a lock. One step is open at a time.

    Memory: one gradient buffer element per parameter element (in `grad_dtype`); with
    parameter-dtype buffers `param.grad` lives in the buffers, so plain training's gradients
    are not doubled (a gradient autograd allocates after a set-to-None reset is copied in and
    freed).
    """

    def __init__(self, module: torch.nn.Module, config: BucketConfig | None = None, *,
                 process_group: dist.ProcessGroup | None = None,
                 run_blocking: RunBlocking | None = None,
                 **options: Unpack[BucketOptions]) -> None:
        self.config = resolve_config("BucketManager", BucketConfig, config, options)
        if not dist.is_initialized():
            raise RuntimeError("bucket manager: expected torch.distributed to be initialized, "
                               "found it is not; call dist.init_process_group() first")
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"module {type(module).__name__}: expected parameters that require "
                             "grad, found none; there is nothing to synchronize")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        nccl = dist.get_backend(process_group) == dist.Backend.NCCL
        op = dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM
        self._divide = not nccl  # gloo has no AVG: divide before the SUM, as DDP does
        self.buckets, self._buffers = layout_buckets(
            named, self.config.grad_dtype, self.config.limits_bytes(), process_group, op,
            run_blocking)
        self._run_blocking = run_blocking
        self._slots = [_Slot(param, name, bucket.index, view) for bucket in self.buckets
                       for param, name, view in zip(bucket.params, bucket.names, bucket.views,
                                                    strict=True)]
        self._slot_of = {id(slot.param): slot for slot in self._slots}
        self._lock = threading.Lock()
        self._no_sync_depth = 0
        self._pending = [len(bucket.params) for bucket in self.buckets]
        self._next_bucket = 0
        self._tasks: list[AllReduceTask] = []
        self._used_map: tuple[torch.Tensor, dist.Work] | None = None
        self._step_open = False
        self._backward_done = False
        self._failure: str | None = None
        self._synchronized = False
        self._last_hook_s = 0.0
        self.last_step: StepTimings | None = None
        """Timings of the last synchronized step (None before the first)."""
        self._hooks = [slot.param.register_post_accumulate_grad_hook(
            functools.partial(self._on_grad, slot)) for slot in self._slots]

    # backward side: runs on autograd's thread ---------------------------------------------

    def _before_grad(self, slot: _Slot, grad: torch.Tensor) -> None:
        """Before autograd accumulates into `.grad`: refuse a gradient that would land in a
        bucket under reduction, or on top of the synchronized one (nothing is touched yet).

        Installed on a parameter from the moment it is ready until `zero_grad()` (the only
        window where a gradient is wrong), not for good: every Python hook on the backward
        thread waits for the GIL, up to a switch interval beside a busy trainer thread."""
        with self._lock:
            if slot.ready:
                raise RuntimeError(
                    f"parameter {slot.name!r}: expected one gradient per step, found a second "
                    "before synchronize(); run the extra backward passes inside no_sync(), or "
                    "await synchronize() and zero_grad() in between")
            if slot.handed_out is not None and slot.param.grad is slot.handed_out():
                raise RuntimeError(
                    f"parameter {slot.name!r}: expected zero_grad() between a synchronized "
                    "step and the next backward, found the synchronized gradient still in "
                    "place; call manager.zero_grad() (or optimizer.zero_grad()) after "
                    "optimizer.step(), or accumulate micro-batches inside no_sync()")

    def _on_grad(self, slot: _Slot, param: torch.nn.Parameter) -> None:
        """After autograd accumulated into `.grad`: move it into the bucket; mark it ready."""
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:  # before it is copied: the bucket stays as it was
            raise TypeError(f"parameter {slot.name!r}: expected a dense gradient, found a sparse "
                            "one; bucketing supports dense gradients only")
        with self._lock:
            if slot.handed_out is not None:  # `.grad` was reset since the last step
                slot.handed_out = None
                slot.contributed = False
            self._contribute(slot, grad)
            slot.used = True
            if self._no_sync_depth == 0:
                self._mark_ready(slot)

    def _contribute(self, slot: _Slot, grad: torch.Tensor) -> None:
        """Put `grad` into the slot's view (copy, or add within an accumulation window). The
        sum is divided by the world size for a whole bucket at its launch (gloo), not here:
        each torch call gives up the GIL, and one per bucket costs fewer waits for it than one
        per parameter beside a busy trainer."""
        view = slot.view
        if slot.same_dtype:
            if grad is not view:  # a fresh gradient (after zero_grad or set_to_none)
                view.copy_(grad)
                slot.param.grad = view
        else:
            if slot.contributed:
                view.add_(grad)
            else:
                view.copy_(grad)
            slot.param.grad = None  # the bucket holds it, in grad_dtype
        slot.contributed = True

    def _mark_ready(self, slot: _Slot) -> None:
        if not self._step_open:
            self._step_open = True
            self._backward_done = False
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        slot.ready = True
        if slot.guard is None:
            slot.guard = slot.param.register_hook(functools.partial(self._before_grad, slot))
        self._last_hook_s = time.perf_counter()
        self._pending[slot.bucket] -= 1
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
            bucket = self.buckets[self._next_bucket]
            if self._divide:  # gloo has no AVG: divide the sum before the SUM, as DDP does
                bucket.buffer.div_(self.world_size)
            self._tasks.append(bucket.start_all_reduce())
            self._next_bucket += 1

    def _on_backward_end(self) -> None:
        with self._lock:
            self._backward_done = True
            missing = [slot for slot in self._slots if not slot.ready]
            if missing and not self.config.find_unused_parameters:
                names = ", ".join(repr(slot.name) for slot in missing[:5])
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                self._failure = (
                    f"parameters {names}{more}: expected a gradient from this backward, found "
                    "none; make every parameter take part in the loss, set requires_grad=False "
                    "on the ones that never do, or pass find_unused_parameters=True")
                raise RuntimeError(self._failure)
            for slot in missing:  # ready with zeros, or with what no_sync() accumulated
                if not slot.used:
                    slot.view.zero_()
                self._mark_ready(slot)
            if self.config.find_unused_parameters:
                used = torch.tensor([slot.used for slot in self._slots], dtype=torch.int32,
                                    device=self._buffers[0].device)
                work = dist.all_reduce(used, group=self.process_group, async_op=True)
                assert work is not None
                self._used_map = (used, work)

    # loop side ------------------------------------------------------------------------------

    async def synchronize(self) -> None:
        """Wait for this step's all-reduces; then each parameter's `.grad` holds its gradient
        averaged over the ranks. Call it after `loss.backward()`, before `optimizer.step()`.

        Returns at once if the step is already synchronized.

        Raises:
            PeerError: an all-reduce failed (a peer died, or the group's timeout ran out);
                the process group is then unusable.
            RuntimeError: no backward ran since the last reset, the last one ran inside
                `no_sync()`, or a parameter got no gradient (the step is then dropped, once its
                launched all-reduces are done; call `zero_grad()` and go on only if every rank
                dropped it too).

        Cancellation: the all-reduces cannot be un-launched; they go on writing into the
        buckets, the step stays open and `.grad` is not yet handed out. Call `synchronize()`
        again to finish the step.
        """
        with self._lock:
            if not self._step_open:
                if self._synchronized:
                    return
                if any(slot.used for slot in self._slots):
                    raise RuntimeError(
                        "bucket manager: expected a backward outside no_sync() before "
                        "synchronize(), found only no_sync() backwards since the last reset; "
                        "run the last micro-batch's backward outside no_sync()")
                raise RuntimeError("bucket manager: expected a backward before synchronize(), "
                                   "found none since the last zero_grad(); call "
                                   "loss.backward() first")
            if not self._backward_done:
                raise RuntimeError("bucket manager: synchronize() called while backward is "
                                   "still running; await it after loss.backward() returns")
            tasks = list(self._tasks)
            used_map = self._used_map
        futures = [task.future for task in tasks if task.future is not None]
        if len(futures) > 1:  # one callback on the backend's thread for them all, not one each
            with contextlib.suppress(Exception):  # each task raises its own error below
                await wait_future(torch.futures.collect_all(futures))
        for task in tasks:
            await task
        if self._failure is not None:
            failure = self._failure
            with self._lock:
                self._drop_step()
            raise RuntimeError(failure)
        used: list[int] | None = None
        if used_map is not None:
            try:
                await wait_work(used_map[1], run_blocking=self._run_blocking)
            except (RuntimeError, dist.DistError) as exc:
                raise peer_error("all-reduce of the used-parameter map", self.process_group,
                                 exc) from exc
            used_tensor = used_map[0]
            if used_tensor.is_cuda:  # tolist() syncs the device: off the loop thread
                used = await (self._run_blocking or asyncio.to_thread)(used_tensor.tolist)
            else:
                used = used_tensor.tolist()
        synchronized_s = time.perf_counter()
        with self._lock:
            if not self._step_open:  # a concurrent synchronize() finished the step
                return
            self._hand_out(used)
            self.last_step = StepTimings(
                num_all_reduces=len(tasks) + (used_map is not None),
                reduce_s=synchronized_s - min(task.started_s for task in tasks),
                exposed_s=max(0.0, synchronized_s - self._last_hook_s))
            self._drop_step()
            self._synchronized = True

    def _hand_out(self, used: list[int] | None) -> None:
        for i, slot in enumerate(self._slots):
            if used is not None and not used[i]:  # no rank used it: leave .grad alone
                continue
            if slot.same_dtype:
                slot.param.grad = slot.view
                slot.handed_out = weakref.ref(slot.view)
            else:
                grad = slot.view.to(slot.param.dtype)
                slot.param.grad = grad
                slot.handed_out = weakref.ref(grad)

    def _drop_step(self) -> None:
        for slot in self._slots:
            slot.ready = slot.used = slot.contributed = False
        self._pending = [len(bucket.params) for bucket in self.buckets]
        self._next_bucket = 0
        self._tasks = []
        self._used_map = None
        self._step_open = False
        self._failure = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the step: each parameter's `.grad` becomes None (or zeros), as
        `optimizer.zero_grad` would, and the buckets are ready for the next backward.

        `optimizer.zero_grad()` (which sets `.grad` to None) resets too; zeroing `.grad` in
        place (`set_to_none=False`) elsewhere than here is not seen, and the next backward
        then raises as if no reset happened.

        Raises:
            BusyError: this step's all-reduces are in flight; await `synchronize()` first.
        """
        with self._lock:
            if self._step_open:
                raise BusyError("bucket manager: expected no step in flight, found one "
                                f"({len(self._tasks)} all-reduces launched); await "
                                "synchronize() before zero_grad()")
            for slot in self._slots:
                slot.handed_out = None
                slot.used = slot.contributed = False
                slot.drop_guard()
                if set_to_none:
                    slot.param.grad = None
                elif slot.same_dtype:
                    slot.param.grad = slot.view
                elif slot.param.grad is not None:
                    slot.param.grad.zero_()
            if not set_to_none:
                for buffer in self._buffers:
                    buffer.zero_()
            self._synchronized = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates gradients (into the buckets); the first backward
        after it (outside) launches the all-reduces of everything accumulated.

        The backward must run inside the block (the forward may run anywhere).
        """
        with self._lock:
            self._no_sync_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._no_sync_depth -= 1

    def main_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """`param`'s gradient view in its bucket, in `grad_dtype` (the fp32 gradient for an
        fp32 master copy). Valid after `synchronize()` until the next backward."""
        slot = self._slot_of.get(id(param))
        if slot is not None and slot.param is param:
            return slot.view
        raise ValueError(f"parameter of shape {tuple(param.shape)}: expected one of this "
                         "manager's parameters, found another; pass a parameter of the module "
                         "the manager was built with")

    def close(self) -> None:
        """Remove the gradient hooks; the module trains as if the manager never existed."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for slot in self._slots:
            slot.drop_guard()

    def __repr__(self) -> str:
        nbytes = sum(bucket.nbytes for bucket in self.buckets)
        state = "step open" if self._step_open else (
            "synchronized" if self._synchronized else "idle")
        return (f"<BucketManager {len(self.buckets)} buckets, {nbytes / MiB:.1f} MiB, "
                f"world size {self.world_size}, {state}>")
