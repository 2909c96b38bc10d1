"""Page-cache calls for prefetch: asking the kernel for mapped pages ahead of use.

The loader's worker processes call these (blocking is theirs to do; never the loop thread's).
They go through ctypes or `os.posix_fadvise`, which release the GIL while the kernel works.

This is advice to this machine's page cache about mappings and local files, not storage I/O,
so it stays here rather than in the storage backend: the bytes themselves were mapped through
the backend (`map_file`), and a backend whose files are not mapped has no pages to advise.
`evict` opens a local path itself (cold-cache benchmarks and tests).

A *range* is `(address, nbytes)` in this process's address space, inside a read-only file
mapping.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Sequence

import numpy as np

PAGE_BYTES = mmap.PAGESIZE
MADV_WILLNEED = 3
#: pages to read ahead that lie at most this far apart are read as one request, gap included:
#: on a corpus sampled densely, a request per sample costs the kernel more than the gaps'
#: pages (the kernel's own read-around on a page fault is 128 KiB); on a sparse one gaps are
#: wider and nothing is merged
READ_GAP_BYTES = 128 << 10

Range = tuple[int, int]

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_mincore.restype = ctypes.c_int


def page_ranges_of(starts: np.ndarray, nbytes: np.ndarray, *,
                   max_gap_bytes: int = 0) -> list[Range]:
    """Page-aligned, sorted, merged ranges covering the spans `starts[i] : starts[i] +
    nbytes[i]` (empty spans dropped); ranges at most `max_gap_bytes` apart become one, gap
    included."""
    keep = nbytes > 0
    begins = starts[keep]
    ends = begins + nbytes[keep]
    if begins.size == 0:
        return []
    begins = begins - begins % PAGE_BYTES
    ends = ends + (-ends) % PAGE_BYTES
    order = np.argsort(begins, kind="stable")
    begins, ends = begins[order], np.maximum.accumulate(ends[order])
    first = np.flatnonzero(np.concatenate(([True], begins[1:] > ends[:-1] + max_gap_bytes)))
    last = np.concatenate((first[1:] - 1, [begins.size - 1]))
    return list(zip(begins[first].tolist(), (ends[last] - begins[first]).tolist(), strict=True))


def _advise_each(ranges: Sequence[Range], advice: int, what: str) -> None:
    for address, nbytes in ranges:
        if _madvise(address, nbytes, advice) != 0:
            code = ctypes.get_errno()
            if code != errno.EINTR:
                raise OSError(code, f"madvise({what}) of {nbytes} bytes at {address:#x}")


class _ProcessMadvise:
    """`process_madvise(2)` on this process: many ranges, one syscall (so one release of the
    GIL, not one per range). Linux 5.10+."""

    def __init__(self) -> None:
        self._pid = -1
        self._pidfd = -1
        self.usable = True

    def __call__(self, ranges: Sequence[Range], advice: int) -> bool:
        """True when every range was advised; False when the kernel refused the call."""
        if not self.usable:
            return False
        if self._pid != os.getpid():  # first call, or a forked child
            try:
                self._pidfd, self._pid = os.pidfd_open(os.getpid()), os.getpid()
            except OSError:
                self.usable = False
                return False
        for start in range(0, len(ranges), _IOV_MAX):
            chunk = ranges[start:start + _IOV_MAX]
            iovecs = np.array(chunk, dtype=np.uint64)  # rows of struct iovec {base, len}
            wanted = int(iovecs[:, 1].sum())
            # `syscall` is variadic: ctypes would pass a bare int as a 32-bit C int
            done = _syscall(ctypes.c_long(_SYS_PROCESS_MADVISE), ctypes.c_int(self._pidfd),
                            ctypes.c_void_p(iovecs.ctypes.data), ctypes.c_size_t(len(chunk)),
                            ctypes.c_int(advice), ctypes.c_uint(0))
            if done != wanted:
                code = ctypes.get_errno()
                if done < 0 and code not in (errno.EINTR, errno.EAGAIN):
                    self.usable = False
                return False
        return True


_SYS_PROCESS_MADVISE = 440  # x86_64 and aarch64 (the generic syscall table)
_IOV_MAX = 1024
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_process_madvise = _ProcessMadvise()


def advise_willneed(ranges: Sequence[Range]) -> None:
    """Start reading `ranges` into the page cache (WILLNEED); returns without waiting for
    the reads (the syscall itself may block briefly: not for the loop thread)."""
    if ranges and not _process_madvise(ranges, MADV_WILLNEED):
        _advise_each(ranges, MADV_WILLNEED, "WILLNEED")


def _resident_pages(address: int, nbytes: int) -> np.ndarray:
    vector = np.empty(-(-nbytes // PAGE_BYTES), np.uint8)
    if _mincore(address, nbytes, vector.ctypes.data) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mincore of {nbytes} bytes at {address:#x}")
    return vector & 1


def resident_bytes(ranges: Sequence[Range]) -> int:
    """Bytes of `ranges` now in the page cache (mincore; for tests and benchmarks)."""
    return sum(int(_resident_pages(a, n).sum()) * PAGE_BYTES for a, n in ranges)
