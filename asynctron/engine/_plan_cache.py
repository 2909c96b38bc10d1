"""`PlanCache`: reuse the plan of a state dict whose structure did not change (seed 002).

A *file plan* is everything a save's structure decides: which items exist (and which tensors are
cut into chunks), how they are split onto bins, where each lands in its file, and the batches
each bin is staged and written in. Trainers save the same structure again and again, so a save
whose keys, kinds, dtypes, shapes and devices match a recent one skips DCP's planner (about
60 µs per tensor) and takes that plan, with the new tensors.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import DTensor

from asynctron.storage import ItemRecord
from asynctron.storage.format import PLAIN_TENSORS, Batches, BinLayout, FlatStateDict


@dataclass(frozen=True, slots=True, eq=False)
class FilePlan:
    """Per item (in plan order): its key, the dim-0 rows of the key's payload it holds (None:
    all), and its manifest record (checksum still None); per bin: its layout, its batches and
    the addresses of its frame pieces."""

    keys: tuple[str, ...]
    rows: tuple[tuple[int, int] | None, ...]
    records: tuple[ItemRecord, ...]
    layouts: tuple[BinLayout, ...]
    batches: tuple[Batches, ...]
    frame_addresses: tuple[np.ndarray, ...]
    """Per bin, uint64 per piece: where a frame piece's bytes (in `frames`) are; 0 for
    bodies."""
    frames: tuple[tuple[bytes, bytes] | None, ...]
    """Per item, the `torch.save` frame around its bytes (DCP's format), or None."""


@dataclass(frozen=True, slots=True)
class PlanCacheStatistics:
    num_hits: int
    num_misses: int
    num_entries: int


def structure_signature(flat: FlatStateDict, *, num_bins: int, rank: int,
                        slab_bytes: int, dtensors: bool = False) -> str | None:
    """What a file plan depends on, as text; None when the state holds tensors whose plan must
    be made fresh each time (tensor subclasses, and, unless `dtensors`, DTensor: DCP's planner
    may place it otherwise; a placement that takes a DTensor's chunk as it is plans it by its
    chunk)."""
    parts = [f"{num_bins}/{rank}/{slab_bytes}"]
    arrays = flat.arrays
    for key, value in flat.values.items():
        if isinstance(value, bytes):
            parts.append(f"{key}\0bytes\0{len(value)}")
        elif type(value) in PLAIN_TENSORS:
            numpy_dtype = arrays[key][0] if key in arrays else ""
            parts.append(f"{key}\0{numpy_dtype}\0{value.dtype}\0{tuple(value.shape)}\0"
                         f"{value.device}")
        elif dtensors and type(value) is DTensor:
            (chunk,) = value.__create_chunk_list__()
            parts.append(f"{key}\0dtensor\0{value.dtype}\0{tuple(value.shape)}\0"
                         f"{tuple(chunk.offsets)}\0{tuple(chunk.sizes)}\0{value.device}")
        else:
            return None
    return "\n".join(parts)


class PlanCache:
    """The file plans of the last `max_entries` distinct global structures (keyed by every
    rank's structure digest), least recently used out.

    Concurrency: thread-safe (saves plan on the engine's executor threads).
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries: expected >= 1, found {max_entries!r}")
        self.max_entries = max_entries
        self._plans: collections.OrderedDict[Hashable, FilePlan] = collections.OrderedDict()
        self._num_hits = 0
        self._num_misses = 0
        self._lock = threading.Lock()

    def snapshot(self) -> dict[Hashable, FilePlan]:
        """The plans held now, by key (what a save announces to the other ranks, and uses)."""
        with self._lock:
            return dict(self._plans)

    def record_use(self, key: Hashable | None, *, hit: bool) -> None:
        """Count a save's outcome: a hit keeps `key` most recently used."""
        with self._lock:
            if hit and key in self._plans:
                self._num_hits += 1
                self._plans.move_to_end(key)
            else:
                self._num_misses += 1

    def store(self, key: Hashable, plan: FilePlan) -> None:
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.max_entries:
                self._plans.popitem(last=False)

    def statistics(self) -> PlanCacheStatistics:
        with self._lock:
            return PlanCacheStatistics(self._num_hits, self._num_misses, len(self._plans))

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<PlanCache {s.num_entries}/{self.max_entries} plans, {s.num_hits} hits, "
                f"{s.num_misses} misses>")
