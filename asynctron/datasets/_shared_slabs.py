"""`SharedSlabs`: batch memory shared by the loader and its worker processes.

One anonymous shared-memory file (`memfd_create`) holds every slab; it is sparse, so only
slabs that were used take memory. A worker writes a batch into a slab; the loader lends the
slab to the batch's tensors and takes it back when the last of them is gone (a weak reference
to the buffer of the slab's array, which every tensor made from it holds). A batch the trainer
keeps is never overwritten: the loader uses another slab.
"""

from __future__ import annotations

import collections
import mmap
import os
import weakref
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

#: the most slabs one loader can have lent out at once (address space only, until used)
MAX_SLABS = 1 << 16
#: address space reserved for the slabs (sparse; memory is taken only by slabs in use)
MAX_RESERVED_BYTES = 64 << 30


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


class SharedSlabs:
    """Slabs of `slab_bytes` in one shared-memory file.

    Args:
        slab_bytes: the size of one slab (a multiple of the page size).
        pin_memory: page-lock each slab for CUDA the first time it is lent (when CUDA is
            available), so host-to-device copies of batches can be asynchronous.

    Concurrency: `take` and `lend` on one thread (the loop); a slab comes back from whichever
    thread drops its batch's last tensor.
    """

    def __init__(self, slab_bytes: int, *, pin_memory: bool = False) -> None:
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
        self._free: collections.deque[int] = collections.deque()
        self._used = 0  # slabs handed out at least once: 0 .. _used - 1
        self._leases: dict[int, weakref.ref[Any]] = {}
        self._pin = pin_memory and torch.cuda.is_available()
        self._pinned: set[int] = set()

    def take(self) -> int:
        """A slab no batch uses now (a new one when every used slab is lent out).

        Raises:
            RuntimeError: `capacity` batches are all still alive.
        """
        if self._free:
            return self._free.popleft()
        if self._used == self.capacity:
            raise RuntimeError(f"loader: all {self.capacity} batch slabs are held by live "
                               "batches; drop batches once used (or copy what you keep)")
        self._used += 1
        return self._used - 1

    def give_back(self, index: int) -> None:
        """Return a slab that was taken but never lent (its batch failed)."""
        self._free.append(index)

    def lend(self, index: int) -> np.ndarray:
        """Slab `index` as a uint8 array, for one batch's tensors (numpy views of it, then
        `torch.from_numpy`); the slab is free again once the array and everything made from
        it are gone."""
        start = index * self.slab_bytes
        slab = np.frombuffer(self._memory[start:start + self.slab_bytes], np.uint8)
        if self._pin and index not in self._pinned:
            _check_cuda(torch.cuda.cudart().cudaHostRegister(slab.ctypes.data, self.slab_bytes,
                                                             0), "cudaHostRegister")
            self._pinned.add(index)
        # numpy's own memoryview of the slab: every view of `slab` keeps it alive
        self._leases[index] = weakref.ref(slab.base, lambda _, index=index: self._returned(index))
        return slab

    def _returned(self, index: int) -> None:
        self._leases.pop(index, None)
        self._free.append(index)

    @property
    def num_lent(self) -> int:
        """Slabs whose batches are still alive."""
        return len(self._leases)

    @property
    def num_used(self) -> int:
        """Slabs ever handed out (the memory they hold stays with the file)."""
        return self._used

    def close(self) -> None:
        """Close the file. While batches still hold slabs, their memory stays mapped (and
        pinned) until the last of them is gone."""
        if self._leases:
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
