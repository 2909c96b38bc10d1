"""The C module: batched copies and digests, and clear errors for bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from asynctron import _native


def _addresses(*arrays: np.ndarray) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrays], dtype=np.uint64)


def test_copy_ranges_copies_and_zero_fills() -> None:
    source = np.arange(1, 11, dtype=np.uint8)
    destination = np.full(12, 7, dtype=np.uint8)
    _native.copy_ranges(_addresses(destination, destination[4:]),
                        np.array([source.ctypes.data + 2, 0], dtype=np.uint64),
                        np.array([4, 8], dtype=np.uint64))
    assert destination.tolist() == [3, 4, 5, 6] + [0] * 8


def test_hash_ranges_matches_the_xxhash_package() -> None:
    buffers = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
               for i, n in enumerate((0, 1, 65_537, 3 << 20))]
    digests = np.zeros(len(buffers), dtype=np.uint64)
    _native.hash_ranges(_addresses(*buffers),
                        np.array([b.nbytes for b in buffers], dtype=np.uint64), digests)
    assert digests.tolist() == [xxhash.xxh3_64_intdigest(b) for b in buffers]


def test_bad_arguments_name_the_argument() -> None:
    ok = np.zeros(2, dtype=np.uint64)
    with pytest.raises(TypeError, match=r"^sources: expected a 1-D array of uint64, found "
                                        r"format i with 1 dimensions$"):
        _native.copy_ranges(ok, np.zeros(2, dtype=np.int32), ok)
    with pytest.raises(ValueError, match=r"^copy_ranges: expected arrays of one length, found "
                                         r"2, 3 and 2$"):
        _native.copy_ranges(ok, np.zeros(3, dtype=np.uint64), ok)
    with pytest.raises(TypeError, match=r"^hash_ranges: expected 3 arguments, found 1$"):
        _native.hash_ranges(ok)  # type: ignore[call-arg]
    frozen = np.zeros(2, dtype=np.uint64)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"read-only"):
        _native.hash_ranges(ok, ok, frozen)
