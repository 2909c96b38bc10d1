"""Staging: copying item bytes out of the caller's tensors into slabs, within the memory budget.

A *slab* is a reusable byte buffer (pinned when CUDA is in use) holding one batch of one bin
file. `SlabPool` hands out slabs under a `ByteBudget` and keeps released ones for reuse, so
a steady stream of saves re-touches warm pages instead of faulting new ones.

A batch is staged by ONE executor call (`stage_batch`), whatever its number of segments, so
the loop's work per batch is constant. Staging only copies (hashing is the writer's, off the
caller's blocking time). Copies, per segment:
- contiguous CPU tensor or bytes: a memcpy (numpy, GIL released);
- any CUDA tensor: `copy_(non_blocking=True)` launched on a per-device copy stream that first
  waits for the stream the save was requested on; the batch's CUDA event is then waited in
  the same executor call, never on the loop;
- non-contiguous (or conjugate/negative-bit) tensors: the segment's flat element range is cut
  into at most 2·ndim+1 strided views copied straight into the slab, so no full contiguous
  temporary is ever made.
"""

from __future__ import annotations

import asyncio
import functools
import math
import mmap
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asynctron._budget import ByteBudget
from asynctron._concurrency import RunBlocking
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
    """The bytes of one item, as the stager reads them: `head`, then the body, then `tail`.

    The body is the payload: `flat` is a uint8 numpy view when it can be memcpy'd (contiguous
    CPU tensor or bytes); otherwise `tensor` is copied range by range with torch. `head` and
    `tail` are constant bytes around it (a `torch.save` frame, in DCP's format), empty for
    plain items; only the body is hashed.
    """

    __slots__ = ("body_nbytes", "flat", "head", "itemsize", "tail", "tensor")

    def __init__(self, payload: torch.Tensor | bytes, *, head: bytes = b"",
                 tail: bytes = b"") -> None:
        self.tensor: torch.Tensor | None = None
        self.flat: np.ndarray | None = None
        self.head, self.tail = head, tail
        if isinstance(payload, bytes):
            self.flat = np.frombuffer(payload, dtype=np.uint8)
            self.itemsize = 1
            self.body_nbytes = len(payload)
            return
        self.itemsize = payload.dtype.itemsize
        self.body_nbytes = payload.numel() * payload.dtype.itemsize
        plain = payload.is_contiguous() and not (payload.is_conj() or payload.is_neg())
        if payload.device.type == "cpu" and plain:
            self.flat = payload.reshape(-1).view(torch.uint8).numpy()
        else:
            self.tensor = payload

    @property
    def is_cuda(self) -> bool:
        return self.tensor is not None and self.tensor.device.type == "cuda"

    def pieces(self, start: int, nbytes: int) -> list[tuple[str, int, int]]:
        """Item bytes [start, +nbytes) as (`"head"`|`"body"`|`"tail"`, lo, hi) ranges, each in
        its piece's own coordinates, in order."""
        bounds = (("head", 0, len(self.head)),
                  ("body", len(self.head), len(self.head) + self.body_nbytes),
                  ("tail", len(self.head) + self.body_nbytes,
                   len(self.head) + self.body_nbytes + len(self.tail)))
        stop = start + nbytes
        return [(name, max(start, lo) - lo, min(stop, hi) - lo) for name, lo, hi in bounds
                if max(start, lo) < min(stop, hi)]


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


def copy_flat_range(flat: torch.Tensor, tensor: torch.Tensor, start: int, stop: int, *,
                    into_tensor: bool, non_blocking: bool = False) -> None:
    """Copy between 1-D `flat` and elements [start, stop) of `tensor` in flattened order (any
    strides): out of `tensor` (staging a save) or, with `into_tensor`, into it (a load)."""
    cursor = 0
    for view in flat_range_views(tensor, start, stop):
        count = view.numel()
        part = flat[cursor:cursor + count].view(view.shape)
        if into_tensor:
            view.copy_(part, non_blocking=non_blocking)
        else:
            part.copy_(view, non_blocking=non_blocking)
        cursor += count


def stage_batch(batch: Batch, sources: Sequence[ItemSource], slab: Slab | None, *,
                snapshot: bool, ready: Mapping[torch.device, torch.cuda.Event],
                copy_stream: Callable[[torch.device], torch.cuda.Stream]
                ) -> tuple[list[memoryview], list[tuple[int, memoryview]]]:
    """Blocks: copy `batch` out of its sources into `slab`. Returns the buffers to write
    (covering the whole batch, padding included) and, per segment, its item's body bytes as
    `(item index, view)`, in file order, for the writer to hash.

    Without `snapshot`, contiguous CPU bytes are not copied: their buffers are the sources'
    own memory. CUDA segments are copied first, on each device's copy stream after the event
    the save was requested at, and waited for here, so CPU copies overlap them.
    """
    views: list[list[memoryview]] = []
    bodies: list[tuple[int, memoryview]] = []
    cuda: dict[torch.device, list[_DeviceCopy]] = {}
    in_place = False
    for segment in batch.segments:
        source = sources[segment.item_index]
        at = segment.batch_offset
        segment_views: list[memoryview] = []
        for piece, lo, hi in source.pieces(segment.item_offset, segment.nbytes):
            nbytes = hi - lo
            if piece != "body":  # frame bytes: constant, not hashed
                frame = memoryview(source.head if piece == "head" else source.tail)[lo:hi]
                if slab is None:
                    in_place = True
                    segment_views.append(frame)
                else:
                    slab.view[at:at + nbytes] = frame
                    segment_views.append(slab.view[at:at + nbytes])
            elif source.flat is not None and not snapshot:
                in_place = True
                segment_views.append(memoryview(source.flat[lo:hi]))
                bodies.append((segment.item_index, segment_views[-1]))
            else:
                assert slab is not None, "a copied segment needs a slab"
                segment_views.append(slab.view[at:at + nbytes])
                bodies.append((segment.item_index, segment_views[-1]))
                if source.flat is not None:
                    np.copyto(slab.array[at:at + nbytes], source.flat[lo:hi])
                elif source.is_cuda:
                    assert source.tensor is not None
                    cuda.setdefault(source.tensor.device, []).append(
                        _DeviceCopy(source, lo, at, nbytes))
                else:
                    assert source.tensor is not None
                    typed = slab.tensor[at:at + nbytes].view(source.tensor.dtype)
                    copy_flat_range(typed, source.tensor, lo // source.itemsize,
                                    hi // source.itemsize, into_tensor=False)
            at += nbytes
        views.append(segment_views)
    events = [_launch_d2h(slab, copies, ready[device], copy_stream(device))
              for device, copies in cuda.items()]
    if slab is not None:
        for lo, hi in _gaps(batch):
            slab.array[lo:hi] = 0
    for event in events:
        event.synchronize()
    if slab is not None and not in_place:
        return [slab.view[:batch.nbytes]], bodies
    return _with_padding(batch, views), bodies


@dataclass(frozen=True, slots=True)
class _DeviceCopy:
    """Body bytes [body_offset, +nbytes) of a CUDA source → slab bytes [at, +nbytes)."""

    source: ItemSource
    body_offset: int
    at: int
    nbytes: int


def _launch_d2h(slab: Slab | None, copies: Sequence[_DeviceCopy],
                ready: torch.cuda.Event, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Queue the device-to-host copies on `stream` (returns at once); returns their event."""
    assert slab is not None
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        for copy in copies:
            tensor = copy.source.tensor
            assert tensor is not None
            itemsize = copy.source.itemsize
            typed = slab.tensor[copy.at:copy.at + copy.nbytes].view(tensor.dtype)
            copy_flat_range(typed, tensor, copy.body_offset // itemsize,
                            (copy.body_offset + copy.nbytes) // itemsize, into_tensor=False,
                            non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


@dataclass(slots=True)
class StagedBatch:
    """A batch ready to write: `buffers` cover all its bytes; `bodies` are its items' bytes,
    `(item index, view)` in file order, to hash; `slab` (if any) goes back to the pool once
    written."""

    batch: Batch
    buffers: list[memoryview]
    bodies: list[tuple[int, memoryview]]
    slab: Slab | None


_ZEROS = memoryview(bytes(4096))


class Stager:
    """Stages batches for one engine: CPU memcpy on the executor, CUDA D2H on copy streams."""

    def __init__(self, pool: SlabPool, run_blocking: RunBlocking) -> None:
        self.pool = pool
        self._run_blocking = run_blocking
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._streams_lock = threading.Lock()

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The engine's copy stream for `device` (thread-safe; created on first use)."""
        with self._streams_lock:
            if device not in self._copy_streams:
                self._copy_streams[device] = torch.cuda.Stream(device=device)
            return self._copy_streams[device]

    @staticmethod
    def mark_ready(tensors: Iterable[torch.Tensor | bytes]
                   ) -> dict[torch.device, torch.cuda.Event]:
        """Record, on each device's current stream, the point a save must copy from.

        Called when the save is requested, so work the caller queues later is not copied.
        """
        events: dict[torch.device, torch.cuda.Event] = {}
        for tensor in tensors:
            if (isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda"
                    and tensor.device not in events):
                events[tensor.device] = torch.cuda.Event()
                events[tensor.device].record(torch.cuda.current_stream(tensor.device))
        return events

    async def stage(self, batch: Batch, sources: Sequence[ItemSource], *, needs_slab: bool,
                    snapshot: bool, ready: Mapping[torch.device, torch.cuda.Event]
                    ) -> StagedBatch:
        """Copy out `batch`: one executor call, whatever its number of segments.

        Memory: borrows one slab from the pool when `needs_slab`.
        Cancellation: the copy in flight finishes; the slab goes back to the pool.
        """
        slab = await self.pool.acquire() if needs_slab else None
        try:
            buffers, bodies = await self._run_blocking(
                functools.partial(stage_batch, snapshot=snapshot, ready=ready,
                                  copy_stream=self.copy_stream),
                batch, sources, slab)
        except BaseException:
            if slab is not None:
                self.pool.release(slab)
            raise
        return StagedBatch(batch, buffers, bodies, slab)


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


def _with_padding(batch: Batch, views: Sequence[Sequence[memoryview]]) -> list[memoryview]:
    """iovecs for a batch: each segment's views, with zero bytes for the gaps between them."""
    buffers: list[memoryview] = []
    cursor = 0
    for segment, segment_views in zip(batch.segments, views, strict=True):
        gap = segment.batch_offset - cursor
        while gap > 0:
            buffers.append(_ZEROS[:min(gap, _ZEROS.nbytes)])
            gap -= buffers[-1].nbytes
        buffers.extend(segment_views)
        cursor = segment.batch_offset + segment.nbytes
    tail = batch.nbytes - cursor
    while tail > 0:
        buffers.append(_ZEROS[:min(tail, _ZEROS.nbytes)])
        tail -= buffers[-1].nbytes
    return buffers
