"""Staging: copying a save's bytes out of the caller's tensors into slabs, and the batches the
writers write (from slabs, or in place from the caller's memory).

A *wave* (every batch a slab could be borrowed for) is staged by ONE executor call, whatever
its number of batches, segments and items: the loop wakes once per wave, and a trainer thread
busy in Python loses the GIL for microseconds, not once per piece. In that call:
- every contiguous CPU piece (tensor bytes, `bytes` values, `torch.save` frames) and every
  gap's zero bytes: one `asynctron._native.copy_ranges` call, a plain memcpy loop with the
  GIL released once (numpy would release and re-take it per piece; torch's copies fan out to
  an intra-op thread pool that stalls on a core the trainer holds);
- CUDA pieces: one `torch._foreach_copy_(non_blocking=True)` per device, launched first on
  the device's copy stream after the event the save was requested at, waited for last;
- strided (non-contiguous, conjugate or negative-bit) CPU pieces: their flat element range
  cut into at most 2·ndim+1 strided views, copied by one `torch._foreach_copy_`, so no full
  contiguous temporary is ever made.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asynctron import _native
from asynctron._memory import memory_at
from asynctron.engine._slabs import Slab
from asynctron.storage.format import Batches, BinLayout, BodySegments, Part

_ZEROS = memoryview(bytes(4096))


class Sources:
    """Where one save's item bodies come from: per item its payload (tensor or bytes) and,
    when its bytes can be memcpy'd (contiguous CPU memory), their address.

    Holds the payloads, so the memory the addresses point at stays alive.
    """

    __slots__ = ("addresses", "payloads")

    def __init__(self, payloads: Sequence[torch.Tensor | bytes]) -> None:
        self.payloads = tuple(payloads)
        self.addresses = np.array([_address(payload) for payload in self.payloads],
                                  dtype=np.uint64)


def _address(payload: torch.Tensor | bytes) -> int:
    """The address of the payload's bytes, or 0 if they are not contiguous CPU memory."""
    if isinstance(payload, bytes):
        return int(np.frombuffer(payload, dtype=np.uint8).ctypes.data) if payload else 0
    if payload.device.type != "cpu" or not payload.is_contiguous() or payload.is_conj() or (
            payload.is_neg()) or not payload.numel():
        return 0
    return payload.data_ptr()


def piece_addresses(layout: BinLayout, sources: Sources, frames: np.ndarray) -> np.ndarray:
    """uint64 per piece of `layout`: where its bytes start in memory (0: copied with torch).
    `frames` holds the frame pieces' addresses (0 for bodies)."""
    return np.where(layout.part == Part.BODY, sources.addresses[layout.item], frames)


@dataclass(frozen=True, slots=True)
class BinSources:
    """One bin of one save: its layout, batches and every piece's address."""

    layout: BinLayout
    batches: Batches
    addresses: np.ndarray
    sources: Sources


@dataclass(slots=True, eq=False)
class StagedBatch:
    """A batch ready to write: from `slab`, or (no slab) in place from the sources' memory.
    Implements the writer's `WriteBatch`; its methods run on the writer's executor thread."""

    bin: BinSources
    index: int
    slab: Slab | None

    @property
    def file_offset(self) -> int:
        return self.bin.batches.file_offset(self.index)

    @property
    def nbytes(self) -> int:
        return self.bin.batches.batch_bytes(self.index)

    def buffers(self) -> list[memoryview]:
        """iovecs covering the batch, padding included."""
        if self.slab is not None:
            return [self.slab.view[:self.nbytes]]
        batches, addresses = self.bin.batches, self.bin.addresses
        segments = batches.segments(self.index)
        buffers: list[memoryview] = []
        cursor = 0
        for address, at, size in zip(
                (addresses[batches.piece[segments]]
                 + batches.piece_offset[segments].astype(np.uint64)).tolist(),
                batches.batch_offset[segments].tolist(), batches.size[segments].tolist(),
                strict=True):
            _pad(buffers, at - cursor)
            buffers.append(memory_at(address, size))  # the sources hold it alive
            cursor = at + size
        _pad(buffers, self.nbytes - cursor)
        return buffers

    def bodies(self) -> BodySegments:
        """Its body segments, in file order, where their bytes are (the slab, or in place)."""
        batches, layout = self.bin.batches, self.bin.layout
        segments = batches.segments(self.index)
        pieces = batches.piece[segments]
        is_body = layout.part[pieces] == Part.BODY
        sizes = batches.size[segments][is_body]
        if self.slab is not None:
            addresses = batches.batch_offset[segments][is_body].astype(np.uint64) + np.uint64(
                self.slab.address)
        else:
            addresses = (self.bin.addresses[pieces[is_body]]
                         + batches.piece_offset[segments][is_body].astype(np.uint64))
        return BodySegments(items=layout.item[pieces][is_body], addresses=addresses,
                            sizes=sizes.astype(np.uint64),
                            whole=sizes == layout.size[pieces[is_body]])


def _pad(buffers: list[memoryview], nbytes: int) -> None:
    while nbytes > 0:
        buffers.append(_ZEROS[:min(nbytes, _ZEROS.nbytes)])
        nbytes -= buffers[-1].nbytes


def in_place(bin: BinSources, index: int) -> bool:
    """Whether a batch can be written straight from the sources' memory: every piece is
    contiguous CPU memory, and the pieces are few and large enough that their iovecs cost
    less than a copy."""
    segments = bin.batches.segments(index)
    count = segments.stop - segments.start
    return count <= _MAX_IN_PLACE_SEGMENTS and bool(
        (bin.addresses[bin.batches.piece[segments]] != 0).all())


_MAX_IN_PLACE_SEGMENTS = 64


class CopyStreams:
    """One CUDA copy stream per device, made on first use (thread-safe)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def __call__(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]


def mark_ready() -> dict[torch.device, torch.cuda.Event]:
    """Record, on the current device's current stream, the point a save copies from (called
    where the save is requested, so work queued later is not copied). Without CUDA in use
    there is nothing to record."""
    if not torch.cuda.is_initialized():
        return {}
    device = torch.device("cuda", torch.cuda.current_device())
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return {device: event}


def stage_wave(wave: Sequence[StagedBatch], ready: Mapping[torch.device, torch.cuda.Event],
               copy_streams: CopyStreams) -> None:
    """Blocks: copy every batch of `wave` into its slab (padding zeroed).

    CUDA pieces are copied on each device's copy stream after its `ready` event (a device
    without one: after the work queued on its current stream now), launched before the CPU
    copies so they overlap, and waited for here, never on the loop.
    """
    destinations: list[np.ndarray] = []
    addresses: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for staged in wave:
        slab, batches = staged.slab, staged.bin.batches
        assert slab is not None, "a staged batch needs a slab"
        segments, gaps = batches.segments(staged.index), batches.gaps(staged.index)
        piece_offset = batches.piece_offset[segments].astype(np.uint64)
        at = batches.batch_offset[segments].astype(np.uint64) + np.uint64(slab.address)
        source = staged.bin.addresses[batches.piece[segments]]
        copyable = source != 0
        destinations += [at[copyable],
                         batches.gap_offset[gaps].astype(np.uint64) + np.uint64(slab.address)]
        addresses += [source[copyable] + piece_offset[copyable],
                      np.zeros(gaps.stop - gaps.start, dtype=np.uint64)]
        sizes += [batches.size[segments][copyable].astype(np.uint64),
                  batches.gap_size[gaps].astype(np.uint64)]
        if not copyable.all():
            _add_tensor_copies(staged, np.flatnonzero(~copyable) + segments.start, by_device)
    events = [launch_copies(dsts, srcs, ready.get(device), copy_streams(device))
              for device, (dsts, srcs) in by_device.items() if device.type == "cuda"]
    if destinations:
        _native.copy_ranges(np.concatenate(destinations), np.concatenate(addresses),
                            np.concatenate(sizes))
    cpu = by_device.get(_CPU)
    if cpu is not None:
        with torch.no_grad():  # sources may require grad: the slab's views must not
            torch._foreach_copy_(*cpu)
    for event in events:
        event.synchronize()


def _add_tensor_copies(staged: StagedBatch, segment_indices: np.ndarray,
                       by_device: dict[torch.device, tuple[list[torch.Tensor],
                                                          list[torch.Tensor]]]) -> None:
    """Queue the segments (body pieces of CUDA or strided tensors) as (slab view, source view)
    pairs: a whole contiguous tensor as itself, against one view of the slab's typed view; any other
    piece as its strided views. A few tensor ops per tensor: 2,590 of them stage as fast, per
    byte, as 160."""
    slab = staged.slab
    assert slab is not None
    batches, layout = staged.bin.batches, staged.bin.layout
    payloads = staged.bin.sources.payloads
    for item, at, size, start in zip(
            layout.item[batches.piece[segment_indices]].tolist(),
            batches.batch_offset[segment_indices].tolist(),
            batches.size[segment_indices].tolist(),
            batches.piece_offset[segment_indices].tolist(), strict=True):
        tensor = payloads[item]
        assert isinstance(tensor, torch.Tensor)
        dtype = tensor.dtype
        itemsize = dtype.itemsize
        device = tensor.device if tensor.is_cuda else _CPU
        destinations, sources = by_device.setdefault(device, ([], []))
        count = size // itemsize
        if at % itemsize == 0 and start == 0 and count == tensor.numel() and (
                tensor.is_contiguous()) and not tensor.is_conj() and not tensor.is_neg():
            destinations.append(slab.typed(dtype).as_strided(tensor.shape, tensor.stride(),
                                                             at // itemsize))
            sources.append(tensor)
            continue
        typed = slab.tensor[at:at + size].view(dtype)
        cursor = 0
        for view in flat_range_views(tensor, start // itemsize, start // itemsize + count):
            destinations.append(typed[cursor:cursor + view.numel()].view(view.shape))
            sources.append(view)
            cursor += view.numel()


_CPU = torch.device("cpu")


def launch_copies(destinations: list[torch.Tensor], sources: list[torch.Tensor],
                  ready: torch.cuda.Event | None, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Queue the copies (device to host, or host to device) on `stream` after `ready` (None:
    after the work queued on the device's current stream now); returns at once, with their
    event."""
    if ready is None:  # e.g. a device other than the one current at the request
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream), torch.no_grad():
        stream.wait_event(ready)
        torch._foreach_copy_(destinations, sources, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


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


def copy_into_flat_range(tensor: torch.Tensor, start: int, stop: int, flat: torch.Tensor, *,
                         non_blocking: bool = False) -> None:
    """Copy 1-D `flat` into elements [start, stop) of `tensor` in flattened order (any strides),
    as a load fills a CUDA or strided target."""
    cursor = 0
    for view in flat_range_views(tensor, start, stop):
        count = view.numel()
        view.copy_(flat[cursor:cursor + count].view(view.shape), non_blocking=non_blocking)
        cursor += count
