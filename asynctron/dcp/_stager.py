"""`AsyncStager`: `dcp.async_save`'s staging into asynctron's process-wide staging memory.

`dcp.async_save` blocks the trainer while its stager makes a copy of the state dict that later
training steps cannot change, then saves that copy on DCP's thread. Stock stagers copy into
freshly allocated tensors each time, so every save pays the first touch of every page (several
times the copy itself, on a VM) and the copy runs on the trainer's thread. This stager copies
into slabs kept warm in asynctron's process-wide cache (`asynctron.staging_statistics()`), on
the engine's executor threads (plain memcpys with the GIL released, CUDA tensors on a copy
stream), under a byte budget.

Stages of `stage(state_dict)` (the caller blocks for all of them):
1. plan (executor): the tensors laid out in slabs: small ones packed into `slab_bytes` slabs
   (64-byte aligned), one larger than a slab in a slab of its own size (so the next save of
   the same model finds the same sizes warm);
2. acquire: the total from the staging budget, at once (after a garbage collection frees the
   copies only reference cycles still hold), the slabs from the cache (missing ones allocated
   on the executor). It never waits: a staged copy is held as long as anything references
   it (a failed save's kept exception does, through its traceback), so what the budget cannot
   lend now is staged outside it, in slabs allocated for this save, with a logged warning.
   A state dict larger than the whole budget is lent alone (when nothing else is staged);
   its slabs stay warm in the cache up to `memory_budget_bytes`;
3. copy (executor, in parallel calls): then the staged state dict is built, its tensors views of
   the slabs.
A slab returns to the cache, and its bytes to the budget, when the last tensor viewing it is
freed: when the save that holds the staged copy ends, whichever writer it used.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import io
import logging
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import staging
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.tensor import DTensor

from asynctron import _native
from asynctron._budget import ByteBudget
from asynctron.dcp._plugin import Plugin
from asynctron.dcp._runtime import Runtime
from asynctron.engine.lowlevel import SLAB_CACHE, Slab, launch_copies, mark_ready
from asynctron.errors import WouldBlock
from asynctron.storage.format import ALIGN_BYTES, SMALL_ALIGN_BYTES, align_up

#: CPU copies are cut into pieces of at most this many bytes, spread over the executor.
_COPY_PIECE_BYTES = 16 << 20
logger = logging.getLogger(__name__)
_KEPT = (int, float, str, bytes, bool, type(None), io.BytesIO, torch.dtype, torch.device,
         torch.Size)


@dataclass(slots=True, eq=False)
class _Leaf:
    """A tensor to stage: its source (a DTensor's local tensor), and where it goes: slab
    `slab` at `offset`."""

    source: torch.Tensor
    nbytes: int
    slab: int = -1
    offset: int = 0


class AsyncStager(Plugin, staging.AsyncStager):
    """DCP's `AsyncStager` on asynctron's staging memory:
    `dcp.async_save(sd, storage_writer=..., async_stager=asynctron.dcp.AsyncStager())`.

    `asynctron.dcp.StorageWriter` stages this way itself, so with it no `async_stager` is
    needed.

    Keyword arguments are `EngineConfig` fields: `memory_budget_bytes` bounds the staged copies
    held at once (by every stager of the process with the same options), `slab_bytes` the slabs
    small tensors are packed into, `num_workers` the copying threads, `pin_memory` whether
    slabs are pinned (default: when CUDA is available).

    Concurrency: any number of threads may stage at once. `memory_budget_bytes` bounds the
    staged copies lent from the process-wide pool; a `stage` never waits for it: when earlier
    saves still hold their copies (a save still running, or a failed save whose exception is
    kept), or the state dict is larger than the budget while another copy is held, the copy
    is made in slabs allocated for it, outside the budget, and a warning is logged.
    Memory: a staged copy's slabs return to the process-wide cache once its save ends (its
    tensors are freed), and stay there, warm, for the next save
    (`asynctron.free_idle_staging()` frees them).
    """

    _synchronize_after_execute: bool = False  # `stage` returns once the copy is made

    def __init__(self, **engine_options: Any) -> None:
        super().__init__("AsyncStager", engine_options)

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """A copy of `state_dict` that later changes to its tensors do not reach: the same
        nesting, every tensor (CPU or CUDA; a DTensor's local shard) copied into staging slabs
        on the CPU, numpy arrays and other objects copied, immutable values kept. For CUDA
        tensors, the value after the work queued on the current stream before this call.

        Blocks until the copy is made.

        Raises:
            TypeError: a tensor subclass other than DTensor (naming the key).
        """
        return stage_state_dict(self._started(), state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns once the copy is made."""

    def close(self) -> None:
        """Nothing to release: staged copies go back to the pool when their saves end."""


def stage_state_dict(runtime: Runtime, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
    """`AsyncStager.stage` on `runtime` (also `StorageWriter.stage`)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a dict, found {type(state_dict).__name__}")
    # Handed over in a box emptied here: the futures that carried it across threads sit in
    # reference cycles, which would otherwise keep the staged copy (and its slabs) until the
    # next garbage collection.
    return runtime.call(_stage(runtime, state_dict, mark_ready())).pop()


async def _stage(runtime: Runtime, state_dict: Mapping[str, Any],
                 ready: Mapping[torch.device, torch.cuda.Event]) -> list[STATE_DICT_TYPE]:
    run_blocking, budget = runtime.run_blocking, runtime.staging_budget
    leaves, sizes = await run_blocking(_plan, state_dict, runtime.config.slab_bytes)
    total = sum(sizes)
    # Never wait for the budget: a staged copy is held until the save that took it is freed,
    # which a kept exception (its traceback holds the staged state dict) delays forever. What
    # the budget cannot lend now is staged outside it, as stock stagers do, with a warning.
    lent = _borrow_now(budget, total)
    if not lent:
        # A finished save's copy may be held only by reference cycles (futures that crossed
        # threads): collect them, and let the releases that queues run, then try again.
        await run_blocking(gc.collect)
        await asyncio.sleep(0)
        lent = _borrow_now(budget, total)
    if not lent:
        logger.warning(
            "AsyncStager: staging %d bytes outside memory_budget_bytes (%d): %d bytes of it "
            "are still held by earlier staged copies (a save still running, or a failed "
            "save whose exception is kept: its traceback holds the staged state dict); "
            "these slabs are allocated for this save, not lent from the budget. Raise "
            "memory_budget_bytes, or drop references to failed saves' exceptions",
            total, budget.total_bytes, budget.borrowed_bytes)
    taken: list[Slab] = []
    pinned = runtime.pool.pinned
    try:
        cached = [SLAB_CACHE.take(size, pinned) for size in sizes]
        taken = [slab for slab in cached if slab is not None]
        missing = [size for size, slab in zip(sizes, cached, strict=True) if slab is None]
        fresh = iter(await run_blocking(_allocate, missing, pinned) if missing else [])
        slabs = [slab if slab is not None else next(fresh) for slab in cached]
        taken = slabs
        await _copy_all(runtime, leaves, slabs, ready)
    except BaseException:
        for slab in taken:
            SLAB_CACHE.give(slab)
        if lent:
            budget.release(total)
        raise
    loop = asyncio.get_running_loop()

    def released(slab: Slab) -> None:  # any thread: a staged copy's last tensor was freed
        if not loop.is_closed():
            loop.call_soon_threadsafe(_give_back, runtime, slab, lent)

    return await run_blocking(_rebuild, state_dict, leaves, slabs, released)


def _borrow_now(budget: ByteBudget, nbytes: int) -> bool:
    """Whether `nbytes` were borrowed from `budget` at once (a state dict larger than the
    whole budget is lent alone, when nothing else is staged)."""
    try:
        budget.acquire_nowait(nbytes)
    except WouldBlock:
        return False
    return True


def _give_back(runtime: Runtime, slab: Slab, lent: bool) -> None:
    SLAB_CACHE.give(slab)
    if lent:
        runtime.staging_budget.release(slab.nbytes)


def _allocate(sizes: list[int], pinned: bool) -> list[Slab]:
    """Blocks: fresh slabs of these sizes (their pages are touched by the copy into them)."""
    return [SLAB_CACHE.allocate(size, pinned) for size in sizes]


def _plan(state_dict: Mapping[str, Any], slab_bytes: int) -> tuple[list[_Leaf], list[int]]:
    """Blocks: every tensor to stage, placed in slabs; the slabs' sizes."""
    leaves: list[_Leaf] = []
    stack: list[tuple[Any, str]] = [(state_dict, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, Mapping):
            stack.extend((value, f"{path}.{key}" if path else str(key))
                         for key, value in reversed(list(node.items())))
        elif type(node) in (list, tuple):
            stack.extend((value, f"{path}.{i}") for i, value in reversed(list(enumerate(node))))
        elif isinstance(node, torch.Tensor):
            tensor = _local(node, path)
            if tensor.numel():
                leaves.append(_Leaf(tensor, tensor.numel() * tensor.element_size()))
    sizes: list[int] = []
    shared = -1  # the slab small tensors are being packed into
    for leaf in leaves:
        if leaf.nbytes > slab_bytes // 2:
            leaf.slab, leaf.offset = len(sizes), 0
            sizes.append(leaf.nbytes)
            continue
        offset = align_up(sizes[shared], SMALL_ALIGN_BYTES) if shared >= 0 else slab_bytes
        if offset + leaf.nbytes > slab_bytes:
            shared, offset = len(sizes), 0
            sizes.append(0)
        leaf.slab, leaf.offset = shared, offset
        sizes[shared] = offset + leaf.nbytes
    return leaves, [align_up(size, ALIGN_BYTES) for size in sizes]


def _local(tensor: torch.Tensor, path: str) -> torch.Tensor:
    """The tensor whose bytes are staged: a DTensor's local shard, else the tensor itself."""
    if isinstance(tensor, DTensor):
        return tensor.to_local().detach()
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"tensor at key {path!r}: expected a tensor or DTensor, found "
                        f"{type(tensor).__module__}.{type(tensor).__qualname__}; AsyncStager "
                        "stages only these")
    return tensor.detach()


async def _copy_all(runtime: Runtime, leaves: list[_Leaf], slabs: list[Slab],
                    ready: Mapping[torch.device, torch.cuda.Event]) -> None:
    """Copy every leaf into its slab: contiguous CPU bytes in parallel executor calls (one
    memcpy loop each, the GIL released), the others with torch (CUDA on the copy stream)."""
    pieces: list[tuple[int, int, int]] = []
    others: list[_Leaf] = []
    for leaf in leaves:
        source = leaf.source
        if source.device.type != "cpu" or not source.is_contiguous() or source.is_conj() or (
                source.is_neg()):
            others.append(leaf)
            continue
        destination = slabs[leaf.slab].address + leaf.offset
        for start in range(0, leaf.nbytes, _COPY_PIECE_BYTES):
            size = min(_COPY_PIECE_BYTES, leaf.nbytes - start)
            pieces.append((destination + start, source.data_ptr() + start, size))
    num_calls = max(1, min(runtime.config.num_workers, len(pieces)))
    groups = [np.array(pieces[i::num_calls], dtype=np.uint64).reshape(-1, 3)
              for i in range(num_calls)]
    async with asyncio.TaskGroup() as group:
        for pieces_of_call in groups:
            if len(pieces_of_call):
                group.create_task(runtime.run_blocking(
                    _native.copy_ranges, np.ascontiguousarray(pieces_of_call[:, 0]),
                    np.ascontiguousarray(pieces_of_call[:, 1]),
                    np.ascontiguousarray(pieces_of_call[:, 2])))
        if others:
            group.create_task(runtime.run_blocking(_copy_with_torch, others, slabs, ready,
                                                   runtime.copy_streams))


def _view(slab: Slab, leaf: _Leaf) -> torch.Tensor:
    """Where `leaf` lands in its slab, shaped as its source: for a contiguous source one view
    of the slab's typed view (the cost per tensor of staging 2,590 of them)."""
    source = leaf.source
    dtype = source.dtype
    if source.is_contiguous() and leaf.offset % dtype.itemsize == 0:
        return slab.typed(dtype).as_strided(source.shape, source.stride(),
                                            leaf.offset // dtype.itemsize)
    return slab.tensor[leaf.offset:leaf.offset + leaf.nbytes].view(dtype).view(source.shape)


def _copy_with_torch(leaves: list[_Leaf], slabs: list[Slab],
                     ready: Mapping[torch.device, torch.cuda.Event],
                     copy_streams: Callable[[torch.device], torch.cuda.Stream]) -> None:
    """Blocks: strided CPU tensors with one `_foreach_copy_`; CUDA tensors on each device's
    copy stream after the point the stage was requested at, waited for here."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for leaf in leaves:
        destinations, sources = by_device.setdefault(leaf.source.device, ([], []))
        destinations.append(_view(slabs[leaf.slab], leaf))
        sources.append(leaf.source)
    events = []
    for device, (destinations, sources) in by_device.items():
        if device.type != "cuda":
            with torch.no_grad():
                torch._foreach_copy_(destinations, sources)
            continue
        events.append(launch_copies(destinations, sources, ready.get(device),
                                     copy_streams(device)))
    for done in events:
        done.synchronize()


def _rebuild(state_dict: Mapping[str, Any], leaves: list[_Leaf], slabs: list[Slab],
             released: Callable[[Slab], None]) -> list[STATE_DICT_TYPE]:
    """Blocks: the staged state dict (in a one-item list), its tensors views of `slabs`; each
    slab is `released` once no tensor views it any more."""
    bases = []
    for slab in slabs:
        lease = slab.array[:]  # a view of the slab whose life the staged tensors decide
        weakref.finalize(lease, released, slab)
        bases.append(torch.from_numpy(lease))
    staged = iter(leaves)

    def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():
            leaf = next(staged)
            view = bases[leaf.slab][leaf.offset:leaf.offset + leaf.nbytes].view(
                local.dtype).view(local.shape)
        else:
            view = torch.empty(local.shape, dtype=local.dtype)
        if isinstance(tensor, DTensor):
            return DTensor.from_local(view, tensor.device_mesh, tensor.placements,
                                      run_check=False, shape=tensor.shape,
                                      stride=tensor.stride())
        return view

    def rebuild(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {key: rebuild(value) for key, value in node.items()}
        if type(node) in (list, tuple):
            return type(node)(rebuild(value) for value in node)
        if isinstance(node, torch.Tensor):
            return copy_tensor(node)
        if isinstance(node, np.ndarray):
            return node.copy()
        if isinstance(node, _KEPT):
            return node
        return copy.deepcopy(node)

    box = [rebuild(state_dict)]
    bases.clear()  # `rebuild` is a cycle (it calls itself): only the staged tensors keep slabs
    return box
