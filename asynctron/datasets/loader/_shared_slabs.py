"""`SharedSlabs`: batch memory shared by the loader and its worker processes.

One anonymous shared-memory file (`memfd_create`) holds every slab; it is sparse, so only
slabs that were used take memory. A worker writes a batch into a slab; the loader lends the
slab's tensors to the batch and takes the slab back once nothing outside the loader refers to
them. A batch the trainer keeps is never overwritten: the loader uses another slab.

A slab's tensors are made the first time it is lent and handed out again each time it comes
round. Freeing a tensor gives up the GIL (twice for one made by `torch.from_numpy`): beside a
trainer thread busy in Python, each of those is a chance for it to take the GIL, and the loop
then waits a switch interval for it back. Tensors that are never freed cost none.
"""

from __future__ import annotations

import collections
import mmap
import os
import sys
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

#: the most slabs one loader can have lent out at once (address space only, until used)
MAX_SLABS = 1 << 16
#: address space reserved for the slabs (sparse; memory is taken only by slabs in use)
MAX_RESERVED_BYTES = 64 << 30

#: a slab's tensors by field, made from the slab as a uint8 array
Views = dict[str, torch.Tensor]


class SlabFile:
    """The shared-memory file, picklable into a spawned worker (its descriptor travels with
    it) and inherited by a forked one."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd = fd
        self.nbytes = nbytes

    def map(self) -> mmap.mmap:
        return mmap.mmap(self.fd, self.nbytes)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_slab_file, (reduction.DupFd(self.fd), self.nbytes)


def _rebuild_slab_file(dup: Any, nbytes: int) -> SlabFile:
    return SlabFile(dup.detach(), nbytes)


class SlabViews:
    """One slab's tensors, and whether anything outside the loader still refers to them.

    Held means: a Python reference to a tensor (a batch dict, a torch `Future`), a C++ one
    (autograd keeping it for the backward pass, a DLPack capsule), or anything else on its
    memory (a view or slice, a numpy array made by `.numpy()`). A tensor changed in place in a
    way that outlives its batch (`unsqueeze_`, `set_`, `requires_grad_`) is not handed out
    again.
    """

    def __init__(self, tensors: Views) -> None:
        self.tensors = tensors
        # held by us, so the storages' addresses stay valid while we count their users
        self._storages = [t.untyped_storage() for t in tensors.values()]
        self._made = self._looks()
        self._counts_unheld = self._counts()

    def _counts(self) -> tuple[int, ...]:
        """Python references, tensor users and storage users of each tensor (this method's
        own included, the same each call). Which of them a C++ holder raises differs between
        torch versions, so all three are compared."""
        counts = [sys.getrefcount(t) for t in self.tensors.values()]
        counts += [t._use_count() for t in self.tensors.values()]
        counts += [torch._C._storage_Use_Count(s._cdata) for s in self._storages]
        return tuple(counts)

    def _looks(self) -> list[tuple[Any, ...]]:
        return [(t.data_ptr(), t.shape, t.stride(), t.dtype, t.requires_grad)
                for t in self.tensors.values()]

    def held(self) -> bool:
        """Whether anything outside the loader refers to the tensors or their memory."""
        return self._counts() != self._counts_unheld

    def unchanged(self) -> bool:
        """Whether the tensors still look as made (for a slab no longer held)."""
        return self._looks() == self._made


class SharedSlabs:
    """Slabs of `slab_bytes` in one shared-memory file.

    Args:
        slab_bytes: the size of one slab (a multiple of the page size).
        views: makes a slab's tensors from the slab as a uint8 array (views of its memory).
        pin_memory: page-lock each slab for CUDA the first time it is lent (when CUDA is
            available), so host-to-device copies of batches can be asynchronous.

    Concurrency: one thread (the loop).
    """

    def __init__(self, slab_bytes: int, views: Callable[[np.ndarray], Views], *,
                 pin_memory: bool = False) -> None:
        self.slab_bytes = slab_bytes
        self.capacity = max(1, min(MAX_SLABS, MAX_RESERVED_BYTES // slab_bytes))
        fd = os.memfd_create("asynctron-batches", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.capacity * slab_bytes)
            self._map = mmap.mmap(fd, self.capacity * slab_bytes)
        except BaseException:
            os.close(fd)
            raise
        self.file = SlabFile(fd, self.capacity * slab_bytes)
        self._memory = memoryview(self._map)
        self._make_views = views
        self._views: dict[int, SlabViews] = {}  # made at a slab's first lend
        self._free: collections.deque[int] = collections.deque()  # not lent
        self._lent: collections.deque[int] = collections.deque()  # oldest first, roughly
        self._used = 0  # slabs handed out at least once: 0 .. _used - 1
        self._pin = pin_memory and torch.cuda.is_available()
        self._pinned: set[int] = set()

    def take(self) -> int:
        """A slab no batch uses now: a free one, else the first lent one found back (a
        slab still held goes to the end of the line), else a new one.

        Raises:
            RuntimeError: `capacity` batches are all still alive.
        """
        if self._free:
            return self._free.popleft()
        for _ in range(len(self._lent)):
            index = self._lent.popleft()
            if not self._views[index].held():
                if not self._views[index].unchanged():
                    del self._views[index]  # remade at its next lend
                return index
            self._lent.append(index)
        if self._used == self.capacity:
            raise RuntimeError(f"loader: all {self.capacity} batch slabs are held by live "
                               "batches; drop batches once used (or copy what you keep)")
        self._used += 1
        return self._used - 1

    def give_back(self, index: int) -> None:
        """Return a slab that was taken but never lent (its batch failed)."""
        self._free.append(index)

    def lend(self, index: int) -> Views:
        """Slab `index`'s tensors, for one batch (a new dict of the same tensors each time
        the slab comes round); the slab is free again once nothing refers to them."""
        views = self._views.get(index)
        if views is None:
            start = index * self.slab_bytes
            slab = np.frombuffer(self._memory[start:start + self.slab_bytes], np.uint8)
            if self._pin and index not in self._pinned:
                _check_cuda(torch.cuda.cudart().cudaHostRegister(
                    slab.ctypes.data, self.slab_bytes, 0), "cudaHostRegister")
                self._pinned.add(index)
            views = self._views[index] = SlabViews(self._make_views(slab))
        self._lent.append(index)
        return dict(views.tensors)

    @property
    def num_lent(self) -> int:
        """Slabs whose batches are still alive."""
        return sum(self._views[index].held() for index in self._lent)

    @property
    def num_used(self) -> int:
        """Slabs ever handed out (the memory they hold stays with the file)."""
        return self._used

    def close(self) -> None:
        """Close the file. While batches still hold slabs, their memory stays mapped (and
        pinned) until the last of them is gone."""
        held = self.num_lent
        self._views.clear()
        self._lent.clear()
        if held:
            os.close(self.file.fd)
            return
        base = np.frombuffer(self._memory, np.uint8).ctypes.data
        for index in self._pinned:
            _check_cuda(torch.cuda.cudart().cudaHostUnregister(base + index * self.slab_bytes),
                        "cudaHostUnregister")
        self._pinned.clear()
        self._memory.release()
        self._map.close()
        os.close(self.file.fd)


def _check_cuda(code: Any, call: str) -> None:
    if int(getattr(code, "value", code)) != 0:
        raise RuntimeError(f"loader: {call} of a batch slab failed with CUDA error {code}")
