"""Staging memory: slabs, the process-wide cache that keeps them warm, and each engine's pool.

A *slab* is a page-aligned byte buffer (pinned when CUDA is in use) holding one batch. The
first touch of a fresh page costs several times a warm one (on this project's VM, 0.5 s per
GiB against 0.05 s for a copy), so slabs are never thrown away with the `Engine` that used
them: they go back to the process-wide `SlabCache`, as torch's caching host allocator keeps
pinned memory, and the next save, of any engine, copies into warm pages.

Trim rule: the cache keeps idle slabs up to the largest `memory_budget_bytes` of the engines
started in this process (what the process already chose to spend on staging); beyond that a
released slab is freed. `free_idle_staging()` frees every idle slab now.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import torch

from asynctron._budget import ByteBudget
from asynctron._concurrency import RunBlocking
from asynctron._memory import PAGE_BYTES, anonymous_pages
from asynctron.errors import WouldBlock


class Slab:
    """One page-aligned staging buffer of `nbytes` (uint8), with numpy, memoryview and torch
    faces and its address. Pinned slabs come from CUDA's host allocator, others from an
    anonymous mmap."""

    __slots__ = ("_mapping", "_typed", "address", "array", "nbytes", "pinned", "tensor", "view")

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        if pinned:
            self._mapping = None
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self._mapping = anonymous_pages(nbytes)
            self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.array = self.tensor.numpy()
        self.view = memoryview(self.array)
        self.address = int(self.array.ctypes.data)
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The slab's bytes as `dtype` elements: one view, made on first use (thread-safe: a
        race makes the same view twice)."""
        view = self._typed.get(dtype)
        if view is None:
            view = self._typed[dtype] = self.tensor.view(dtype)
        return view

    def prefault(self) -> None:
        """Blocks: touch every page (one numpy call; the GIL is released)."""
        self.array[::PAGE_BYTES] = 0


@dataclass(frozen=True, slots=True)
class SlabCacheStatistics:
    """A snapshot of the process-wide `SlabCache`."""

    idle_bytes: int
    """Bytes of slabs kept for reuse, not borrowed by any engine."""
    max_idle_bytes: int
    """The trim bound: idle slabs beyond it are freed on release."""
    num_reused: int
    """Slabs handed out warm, from the cache."""
    num_allocated: int
    """Slabs allocated fresh (their pages are first touched by the copy into them)."""


class SlabCache:
    """Idle slabs of every size and kind, shared by all engines of the process.

    Concurrency: thread-safe (engines may run on several loops, e.g. a `BackgroundEngine`).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[Slab]] = {}
        self._idle_bytes = 0
        self._max_idle_bytes = 0
        self._num_reused = 0
        self._num_allocated = 0
        self._lock = threading.Lock()

    def admit(self, budget_bytes: int) -> None:
        """Raise the trim bound to `budget_bytes` (an engine with this budget started)."""
        with self._lock:
            self._max_idle_bytes = max(self._max_idle_bytes, budget_bytes)

    def take(self, nbytes: int, pinned: bool) -> Slab | None:
        """An idle slab of this size and kind, or None."""
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if not free:
                return None
            self._idle_bytes -= nbytes
            self._num_reused += 1
            return free.pop()

    def num_idle(self, nbytes: int, pinned: bool) -> int:
        """Idle slabs of this size and kind (a momentary value)."""
        with self._lock:
            return len(self._free.get((nbytes, pinned), ()))

    def allocate(self, nbytes: int, pinned: bool) -> Slab:
        """Blocks (mmap or pinned allocation): a fresh slab; its pages are not touched yet."""
        slab = Slab(nbytes, pinned)
        with self._lock:
            self._num_allocated += 1
        return slab

    def give(self, slab: Slab) -> None:
        """Keep `slab` for reuse, or drop it if the cache is at its bound."""
        with self._lock:
            if self._idle_bytes + slab.nbytes <= self._max_idle_bytes:
                self._free.setdefault((slab.nbytes, slab.pinned), []).append(slab)
                self._idle_bytes += slab.nbytes

    def trim(self) -> int:
        """Free every idle slab; returns the bytes freed."""
        with self._lock:
            freed, self._idle_bytes = self._idle_bytes, 0
            self._free.clear()
        return freed

    def statistics(self) -> SlabCacheStatistics:
        with self._lock:
            return SlabCacheStatistics(self._idle_bytes, self._max_idle_bytes,
                                       self._num_reused, self._num_allocated)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<SlabCache {s.idle_bytes} idle bytes of at most {s.max_idle_bytes}, "
                f"{s.num_reused} reused, {s.num_allocated} allocated>")


SLAB_CACHE = SlabCache()
"""The process's one slab cache."""


def free_idle_staging() -> int:
    """Free every staging slab no save is using, in this process (they are otherwise kept, so
    that later saves, of any engine, copy into warm pages). Returns the bytes freed."""
    return SLAB_CACHE.trim()


def staging_statistics() -> SlabCacheStatistics:
    """The process-wide staging cache now: idle bytes, its bound, slabs reused and allocated."""
    return SLAB_CACHE.statistics()


class SlabPool:
    """One engine's slabs of `slab_bytes`: never more bytes borrowed at once than its budget
    allows; slabs come from, and go back to, the process-wide cache.

    Memory: at most `budget.total_bytes` rounded down to whole slabs (at least one) are
    borrowed by this engine at once.
    """

    def __init__(self, budget: ByteBudget, slab_bytes: int, pin_memory: bool | None,
                 run_blocking: RunBlocking, cache: SlabCache = SLAB_CACHE) -> None:
        self.budget = budget
        self.slab_bytes = slab_bytes
        self._pin_memory = pin_memory
        self._run_blocking = run_blocking
        self._cache = cache
        cache.admit(budget.total_bytes)
        #: Events set whenever an acquire has to wait: writers holding back start writing.
        self.pressure_listeners: set[asyncio.Event] = set()

    @property
    def pinned(self) -> bool:
        """Whether slabs taken now are pinned: `pin_memory`, or (None) once this process uses
        CUDA, so a CPU-only trainer on a GPU machine never starts a CUDA context."""
        return torch.cuda.is_initialized() if self._pin_memory is None else self._pin_memory

    @property
    def num_waiting(self) -> int:
        """Acquires waiting for budget (read from any thread: a momentary value)."""
        return self.budget.statistics().num_waiting

    @property
    def num_warm(self) -> int:
        """Idle slabs of this pool's size and kind in the cache: copies into them touch no
        fresh page (a momentary value)."""
        return self._cache.num_idle(self.slab_bytes, self.pinned)

    async def acquire(self, count: int) -> list[Slab]:
        """At least one slab (waiting for budget), then as many more as the budget allows now,
        up to `count`; slabs the cache lacks are allocated in one executor call.

        Cancellation: nothing is borrowed.
        """
        nbytes = self.slab_bytes
        try:
            self.budget.acquire_nowait(nbytes)
        except WouldBlock:
            for listener in self.pressure_listeners:
                listener.set()
            await self.budget.acquire(nbytes)
        granted = 1
        while granted < count:
            try:
                self.budget.acquire_nowait(nbytes)
            except WouldBlock:
                break
            granted += 1
        pinned = self.pinned
        slabs = [slab for _ in range(granted)
                 if (slab := self._cache.take(nbytes, pinned)) is not None]
        try:
            if len(slabs) < granted:
                slabs += await self._run_blocking(self._allocate, granted - len(slabs), pinned)
        except BaseException:
            for slab in slabs:
                self._cache.give(slab)
            self.budget.release(granted * nbytes)
            raise
        return slabs

    def _allocate(self, count: int, pinned: bool) -> list[Slab]:
        return [self._cache.allocate(self.slab_bytes, pinned) for _ in range(count)]

    def release(self, slab: Slab) -> None:
        self._cache.give(slab)
        self.budget.release(self.slab_bytes)

    async def prefault(self, nbytes: int) -> int:
        """Make sure the cache holds warm slabs for `nbytes` (at most the budget): allocate
        and touch the missing ones, off the loop. Returns the bytes made warm.

        Memory: borrows the slabs under the budget while touching them, then leaves them idle
        in the cache.
        Cancellation: slabs touched so far stay in the cache.
        """
        count = min(-(-nbytes // self.slab_bytes), self.budget.total_bytes // self.slab_bytes)
        warmed: list[Slab] = []
        try:
            while len(warmed) < count:
                slabs = await self.acquire(count - len(warmed))
                try:
                    await self._run_blocking(_prefault_all, slabs)
                finally:
                    warmed += slabs
        finally:
            for slab in warmed:
                self.release(slab)
        return len(warmed) * self.slab_bytes


def _prefault_all(slabs: list[Slab]) -> None:
    for slab in slabs:
        slab.prefault()
