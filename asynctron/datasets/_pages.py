"""Blocking page-cache calls for prefetch: asking the kernel for mapped pages ahead of use.

Every call here blocks (or may) and must run on the engine's executor through a `RunBlocking`
door, never on the loop thread. They go through ctypes or `os.posix_fadvise`, which release the
GIL while the kernel works (`mmap.madvise` would hold it, stalling the loop thread too).

A *range* is `(address, nbytes)` in this process's address space, inside a read-only file
mapping. `array_ranges` computes the ranges of some elements of a mapped array from its base
pointer and strides, without touching (and so faulting in) any of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
from collections.abc import Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
MADV_WILLNEED = 3
MADV_POPULATE_READ = 22  # Linux 5.14+: fault the pages in, waiting for the reads

Range = tuple[int, int]

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_mincore.restype = ctypes.c_int
_populate_supported = True


def page_ranges(spans: Iterable[Range]) -> list[Range]:
    """Page-aligned, sorted, merged ranges covering `spans` (empty spans dropped)."""
    aligned = sorted((start - start % PAGE_BYTES,
                      start + nbytes + (-(start + nbytes)) % PAGE_BYTES)
                     for start, nbytes in spans if nbytes > 0)
    merged: list[list[int]] = []
    for begin, end in aligned:
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return [(begin, end - begin) for begin, end in merged]


def total_bytes(ranges: Sequence[Range]) -> int:
    return sum(nbytes for _, nbytes in ranges)


def array_ranges(array: np.ndarray, rows: np.ndarray) -> list[Range]:
    """Page ranges holding `array[rows]` (rows along the first axis), computed from the array's
    address: nothing is read."""
    if array.size == 0 or rows.size == 0:
        return []
    base = array.ctypes.data
    row_bytes = array.strides[0]
    starts = base + np.asarray(rows, np.int64) * row_bytes
    return page_ranges(zip(starts.tolist(), [row_bytes] * rows.size, strict=True))


def _advise(address: int, nbytes: int, advice: int) -> int:
    if _madvise(address, nbytes, advice) == 0:
        return 0
    return ctypes.get_errno()


def advise_willneed(ranges: Sequence[Range]) -> None:
    """Start reading `ranges` into the page cache (madvise WILLNEED); returns without waiting.
    Blocking call: run it through `RunBlocking`."""
    for address, nbytes in ranges:
        code = _advise(address, nbytes, MADV_WILLNEED)
        if code:
            raise OSError(code, f"madvise(WILLNEED) of {nbytes} bytes at {address:#x}")


def populate(ranges: Sequence[Range]) -> None:
    """Read `ranges` in and map them, returning when they are resident: every read is started
    first (WILLNEED), then awaited (MADV_POPULATE_READ), so the reads overlap. Where the kernel
    lacks POPULATE_READ (before Linux 5.14), only the reads are started. Blocking call: run it
    through `RunBlocking`."""
    global _populate_supported
    advise_willneed(ranges)
    if not _populate_supported:
        return
    for address, nbytes in ranges:
        code = _advise(address, nbytes, MADV_POPULATE_READ)
        if code == errno.EINVAL:
            logger.info("madvise(MADV_POPULATE_READ) unsupported; prefetch only starts reads")
            _populate_supported = False
            return
        if code and code != errno.EINTR:
            raise OSError(code, f"madvise(POPULATE_READ) of {nbytes} bytes at {address:#x}")


def resident_bytes(ranges: Sequence[Range]) -> int:
    """Bytes of `ranges` now in the page cache and mapped (mincore). Blocking call."""
    resident = 0
    for address, nbytes in ranges:
        num_pages = -(-nbytes // PAGE_BYTES)
        vector = (ctypes.c_ubyte * num_pages)()
        if _mincore(address, nbytes, vector) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"mincore of {nbytes} bytes at {address:#x}")
        resident += sum(1 for flag in vector if flag & 1) * PAGE_BYTES
    return resident


def evict(path: str) -> None:
    """Drop `path`'s clean pages from the page cache (fadvise DONTNEED), for cold-cache runs.
    Pages still mapped by a process may stay. Blocking call."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
