"""Raw memory by address: views of the bytes the native copies and digests
(`asynctron._native`) work on, for the Python code beside them."""

from __future__ import annotations

import ctypes


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable view of the `nbytes` bytes at `address`, which the caller keeps alive (it
    holds the tensor or slab they belong to) for as long as the view is used."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")
