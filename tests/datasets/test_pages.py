"""Page-cache calls: ranges aligned and merged; WILLNEED reads pages in; DONTNEED evicts
them."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time

import numpy as np
import pytest

from asynctron.bench._baselines import evict_page_cache
from asynctron.datasets.loader import _pages
from asynctron.datasets.loader._pages import PAGE_BYTES


def test_page_ranges_align_and_merge() -> None:
    p = PAGE_BYTES
    starts = np.array([10, p - 1, 5 * p, 3 * p + 7])
    assert _pages.page_ranges_of(starts, np.array([5, 2, 0, p])) == [(0, 2 * p), (3 * p, 2 * p)]
    assert _pages.page_ranges_of(np.zeros(0, np.int64), np.zeros(0, np.int64)) == []


def test_page_ranges_closer_than_the_gap_are_read_as_one() -> None:
    p = PAGE_BYTES
    starts, nbytes = np.array([9 * p, 0, 3 * p]), np.array([p, p, p])
    assert _pages.page_ranges_of(starts, nbytes) == [(0, p), (3 * p, p), (9 * p, p)]
    assert _pages.page_ranges_of(starts, nbytes, max_gap_bytes=2 * p) == [(0, 4 * p), (9 * p, p)]
    assert _pages.page_ranges_of(starts, nbytes, max_gap_bytes=5 * p) == [(0, 10 * p)]


def test_willneed_reads_evicted_pages_in(tmp_path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * PAGE_BYTES))
    evict_page_cache([str(path)])
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, np.uint8)
    wanted = [(view.ctypes.data + 8 * PAGE_BYTES, 4 * PAGE_BYTES)]
    assert _pages.resident_bytes(wanted) == 0  # evicted (the disk is not tmpfs here)
    _pages.advise_willneed(wanted)  # starts the reads; they finish soon after
    deadline = time.monotonic() + 30
    while _pages.resident_bytes(wanted) < 4 * PAGE_BYTES and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _pages.resident_bytes(wanted) == 4 * PAGE_BYTES
    assert _pages.resident_bytes([(view.ctypes.data + 40 * PAGE_BYTES, PAGE_BYTES)]) == 0
    del view
    mapped.close()


def test_the_blocking_calls_release_the_gil() -> None:
    """ctypes foreign calls drop the GIL (a CDLL, not a PyDLL); mmap.madvise would not."""
    assert not isinstance(_pages._libc, ctypes.PyDLL)
    assert _pages._madvise.__class__.__name__ == "_FuncPtr"
    assert not (_pages._libc._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI)


def test_process_madvise_advises_every_range_in_one_call(tmp_path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * PAGE_BYTES))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapped, np.uint8)
    base = view.ctypes.data
    advise = _pages._ProcessMadvise()
    advised = advise([(base, PAGE_BYTES), (base + 8 * PAGE_BYTES, 2 * PAGE_BYTES)],
                     _pages.MADV_WILLNEED)
    if not advised and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        pytest.skip("this kernel (or its seccomp filter) refuses process_madvise")
    assert advised and advise.usable  # the call took 64-bit addresses (it once got 32)
    del view
    mapped.close()
