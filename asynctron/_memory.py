"""Raw memory as bytes: views of the memory the native copies and digests (`asynctron._native`)
and the readers work on, for the Python code beside them."""

from __future__ import annotations

import ctypes
import mmap

import torch

#: The size of a memory page.
PAGE_BYTES = mmap.PAGESIZE


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable view of the `nbytes` bytes at `address`, which the caller keeps alive (it
    holds the tensor or slab they belong to) for as long as the view is used."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def anonymous_pages(nbytes: int) -> mmap.mmap:
    """`nbytes` of fresh, page-aligned memory backed by no file (an anonymous map); its pages
    are not touched yet. Unmapped once nothing refers to it."""
    return mmap.mmap(-1, nbytes)
