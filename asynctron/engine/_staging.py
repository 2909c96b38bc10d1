"""Staging: copying item bytes out of the caller's tensors into slabs, within the memory budget.

A *slab* is a reusable byte buffer (pinned when CUDA is in use) holding one batch of one bin
file. `SlabPool` hands out slabs under a `ByteBudget` and keeps released ones for reuse, so
a steady stream of saves re-touches warm pages instead of faulting new ones.

Copies, per segment of a batch:
- contiguous CPU tensor or bytes: a memcpy (numpy, GIL released) on the engine's executor;
- any CUDA tensor: `copy_(non_blocking=True)` launched on a per-device copy stream that first
  waits for the stream the save was requested on; the batch's CUDA event is then waited on
  the executor, never on the loop;
- non-contiguous (or conjugate/negative-bit) tensors: the segment's flat element range is cut
  into at most 2·ndim+1 strided views copied straight into the slab, so no full contiguous
  temporary is ever made.
"""

from __future__ import annotations

import asyncio
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asynctron._concurrency import RunBlocking
from asynctron.engine._budget import ByteBudget
from asynctron.errors import WouldBlock
from asynctron.storage._layout import Batch


class Slab:
    """One page-aligned staging buffer of `nbytes` (uint8), with numpy and memoryview faces.

    Page alignment lets writes of whole slabs bypass the page cache (O_DIRECT). Pinned slabs
    come from CUDA's host allocator (page-aligned); others from an anonymous mmap.
    """

    __slots__ = ("_mapping", "array", "nbytes", "tensor", "view")

    def __init__(self, nbytes: int, pin_memory: bool) -> None:
        self.nbytes = nbytes
        if pin_memory:
            self._mapping = None
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self._mapping = mmap.mmap(-1, nbytes)
            self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.array = self.tensor.numpy()
        self.view = memoryview(self.array)


class SlabPool:
    """Slabs of `slab_nbytes` each, never more bytes than the budget allows at once.

    Memory: at most `budget.total_bytes` rounded down to whole slabs are held (at least one);
    released slabs stay allocated for reuse until `trim()`.
    """

    def __init__(self, budget: ByteBudget, slab_nbytes: int, pin_memory: bool,
                 run_blocking: RunBlocking) -> None:
        self.budget = budget
        self.slab_nbytes = slab_nbytes
        self.pin_memory = pin_memory
        self._run_blocking = run_blocking
        self._free: list[Slab] = []
        self.num_allocated = 0
        #: Events set whenever an acquire has to wait: writers holding back start writing.
        self.pressure_listeners: set[asyncio.Event] = set()

    async def acquire(self) -> Slab:
        """A slab for one batch. Cancellation: nothing is borrowed."""
        try:
            self.budget.acquire_nowait(self.slab_nbytes)
        except WouldBlock:
            for listener in self.pressure_listeners:
                listener.set()
            await self.budget.acquire(self.slab_nbytes)
        if self._free:
            return self._free.pop()
        try:
            slab = await self._run_blocking(Slab, self.slab_nbytes, self.pin_memory)
        except BaseException:
            self.budget.release(self.slab_nbytes)
            raise
        self.num_allocated += 1
        return slab

    def release(self, slab: Slab) -> None:
        self._free.append(slab)
        self.budget.release(self.slab_nbytes)

    def trim(self) -> None:
        """Free every slab not in use (e.g. after the budget shrank, or on close)."""
        self.num_allocated -= len(self._free)
        self._free.clear()


class ItemSource:
    """The bytes of one item, as the stager reads them.

    `flat` is a uint8 numpy view when the bytes can be memcpy'd (contiguous CPU tensor or
    bytes); otherwise `tensor` is copied range by range with torch.
    """

    __slots__ = ("flat", "itemsize", "tensor")

    def __init__(self, payload: torch.Tensor | bytes) -> None:
        self.tensor: torch.Tensor | None = None
        self.flat: np.ndarray | None = None
        if isinstance(payload, bytes):
            self.flat = np.frombuffer(payload, dtype=np.uint8)
            self.itemsize = 1
            return
        self.itemsize = payload.dtype.itemsize
        plain = payload.is_contiguous() and not (payload.is_conj() or payload.is_neg())
        if payload.device.type == "cpu" and plain:
            self.flat = payload.reshape(-1).view(torch.uint8).numpy()
        else:
            self.tensor = payload

    @property
    def is_cuda(self) -> bool:
        return self.tensor is not None and self.tensor.device.type == "cuda"

    def direct_view(self, start: int, nbytes: int) -> memoryview | None:
        """The item's own bytes [start, +nbytes), if they can be written in place."""
        if self.flat is None:
            return None
        return memoryview(self.flat[start:start + nbytes])


def flat_range_views(tensor: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
    """Strided views of `tensor` that, concatenated, are `tensor.flatten()[start:stop]`.

    At most 2·ndim+1 views; nothing is copied.
    """
    if start >= stop:
        return []
    if tensor.dim() <= 1:
        return [tensor.reshape(-1)[start:stop]]
    row = math.prod(tensor.shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:
        return flat_range_views(tensor[first], start - first * row, stop - first * row)
    views: list[torch.Tensor] = []
    if start % row:
        views += flat_range_views(tensor[first], start - first * row, row)
        first += 1
    full_end = last + 1 if stop % row == 0 else last
    if full_end > first:
        views.append(tensor[first:full_end])
    if stop % row:
        views += flat_range_views(tensor[last], 0, stop - last * row)
    return views


@dataclass(frozen=True, slots=True)
class _Copy:
    """Item bytes [item_offset, +nbytes) of `source` → slab bytes [slab_offset, +nbytes)."""

    source: ItemSource
    item_offset: int
    slab_offset: int
    nbytes: int


def _copy_into_slab(slab: Slab, copy: _Copy, non_blocking: bool) -> None:
    src = copy.source
    lo, hi = copy.slab_offset, copy.slab_offset + copy.nbytes
    if src.flat is not None:
        np.copyto(slab.array[lo:hi], src.flat[copy.item_offset:copy.item_offset + copy.nbytes])
        return
    assert src.tensor is not None
    typed = slab.tensor[lo:hi].view(src.tensor.dtype)
    start = copy.item_offset // src.itemsize
    cursor = 0
    for view in flat_range_views(src.tensor, start, start + copy.nbytes // src.itemsize):
        count = view.numel()
        typed[cursor:cursor + count].view(view.shape).copy_(view, non_blocking=non_blocking)
        cursor += count


def _stage_cpu(slab: Slab, copies: Sequence[_Copy], zero_ranges: Sequence[tuple[int, int]],
               wait_cuda: Callable[[], None] | None) -> None:
    """Blocks: memcpy the CPU segments, zero the padding, then wait for the CUDA copies."""
    for copy in copies:
        _copy_into_slab(slab, copy, non_blocking=False)
    for lo, hi in zero_ranges:
        slab.array[lo:hi] = 0
    if wait_cuda is not None:
        wait_cuda()


@dataclass(slots=True)
class StagedBatch:
    """A batch ready to write: `buffers` cover all its bytes; `segment_views[i]` holds
    segment i's bytes (for the checksum); `slab` (if any) goes back to the pool once written."""

    batch: Batch
    buffers: list[memoryview]
    segment_views: list[memoryview]
    slab: Slab | None


_ZEROS = memoryview(bytes(4096))


class Stager:
    """Stages batches for one engine: CPU memcpy on the executor, CUDA D2H on copy streams."""

    def __init__(self, pool: SlabPool, run_blocking: RunBlocking) -> None:
        self.pool = pool
        self._run_blocking = run_blocking
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device=device)
        return self._copy_streams[device]

    @staticmethod
    def mark_ready(sources: Sequence[ItemSource]) -> dict[torch.device, torch.cuda.Event]:
        """Record, on each device's current stream, the point the save must copy from.

        Called when the save is requested, so work queued later by the caller is not copied.
        """
        events: dict[torch.device, torch.cuda.Event] = {}
        for source in sources:
            if source.is_cuda:
                assert source.tensor is not None
                device = source.tensor.device
                if device not in events:
                    events[device] = torch.cuda.Event()
                    events[device].record(torch.cuda.current_stream(device))
        return events

    async def stage(self, batch: Batch, sources: Sequence[ItemSource], *, snapshot: bool,
                    ready: dict[torch.device, torch.cuda.Event]) -> StagedBatch:
        """Copy out `batch`; when `snapshot` is False, contiguous CPU bytes are written in place.

        Memory: borrows one slab from the pool unless every segment is written in place.
        Cancellation: copies already running finish first; the slab goes back to the pool.
        """
        direct = [None if snapshot else sources[s.item_index].direct_view(s.item_offset, s.nbytes)
                  for s in batch.segments]
        if batch.segments and all(view is not None for view in direct):
            return StagedBatch(batch, _with_padding(batch, direct), direct, None)
        slab = await self.pool.acquire()
        try:
            await self._fill(slab, batch, sources, direct, ready)
        except BaseException:
            self.pool.release(slab)
            raise
        slab_views = [slab.view[s.batch_offset:s.batch_offset + s.nbytes] for s in batch.segments]
        views = [d if d is not None else v for d, v in zip(direct, slab_views, strict=True)]
        buffers = ([slab.view[:batch.nbytes]] if all(d is None for d in direct)
                   else _with_padding(batch, views))
        return StagedBatch(batch, buffers, views, slab)

    async def _fill(self, slab: Slab, batch: Batch, sources: Sequence[ItemSource],
                    direct: Sequence[memoryview | None],
                    ready: dict[torch.device, torch.cuda.Event]) -> None:
        cpu_copies, cuda_copies = [], []
        for segment, view in zip(batch.segments, direct, strict=True):
            if view is None:
                source = sources[segment.item_index]
                copy = _Copy(source, segment.item_offset, segment.batch_offset, segment.nbytes)
                (cuda_copies if source.is_cuda else cpu_copies).append(copy)
        wait_cuda = self._launch_cuda(slab, cuda_copies, ready) if cuda_copies else None
        await self._run_blocking(_stage_cpu, slab, cpu_copies, _gaps(batch), wait_cuda)

    def _launch_cuda(self, slab: Slab, copies: Sequence[_Copy],
                     ready: dict[torch.device, torch.cuda.Event]) -> Callable[[], None]:
        """Queue the D2H copies (returns at once); returns the blocking wait for them."""
        events = []
        by_device: dict[torch.device, list[_Copy]] = {}
        for copy in copies:
            assert copy.source.tensor is not None
            by_device.setdefault(copy.source.tensor.device, []).append(copy)
        for device, device_copies in by_device.items():
            stream = self.copy_stream(device)
            with torch.cuda.stream(stream):
                stream.wait_event(ready[device])
                for copy in device_copies:
                    _copy_into_slab(slab, copy, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            events.append(event)

        def wait() -> None:
            for event in events:
                event.synchronize()

        return wait


def _gaps(batch: Batch) -> list[tuple[int, int]]:
    """Batch byte ranges no segment covers (padding between items)."""
    gaps, cursor = [], 0
    for segment in batch.segments:
        if segment.batch_offset > cursor:
            gaps.append((cursor, segment.batch_offset))
        cursor = segment.batch_offset + segment.nbytes
    if batch.nbytes > cursor:
        gaps.append((cursor, batch.nbytes))
    return gaps


def _with_padding(batch: Batch, views: Sequence[memoryview | None]) -> list[memoryview]:
    """iovecs for a batch: each segment's view, with zero bytes for the gaps between them."""
    buffers: list[memoryview] = []
    cursor = 0
    for segment, view in zip(batch.segments, views, strict=True):
        assert view is not None
        gap = segment.batch_offset - cursor
        while gap > 0:
            buffers.append(_ZEROS[:min(gap, _ZEROS.nbytes)])
            gap -= buffers[-1].nbytes
        buffers.append(view)
        cursor = segment.batch_offset + segment.nbytes
    tail = batch.nbytes - cursor
    while tail > 0:
        buffers.append(_ZEROS[:min(tail, _ZEROS.nbytes)])
        tail -= buffers[-1].nbytes
    return buffers
