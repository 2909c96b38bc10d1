"""The C module: batched copies and digests, token gathering, a pipe read that keeps the GIL,
and clear errors for bad arguments."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64,
                                   np.float32, np.float64])
def test_gather_tokens_widens_runs_as_numpy_does(dtype: type) -> None:
    tokens = (np.arange(100) % 97 - 5).astype(dtype)
    out = np.full((2, 8), -1, dtype=np.int64)
    _native.gather_tokens(tokens, np.array([5, 50], np.int64), np.array([6, 3], np.int64), out,
                          np.array([0, 9], np.int64))
    expected = np.full((2, 8), -1, dtype=np.int64)
    expected[0, :6] = tokens[5:11].astype(np.int64)
    expected[1, 1:4] = tokens[50:53].astype(np.int64)
    assert out.tolist() == expected.tolist()


def test_gather_tokens_refuses_runs_outside_its_arrays() -> None:
    tokens = np.arange(10, dtype=np.uint16)
    out = np.zeros(4, dtype=np.int64)
    one = np.array([1], np.int64)
    with pytest.raises(ValueError, match=r"^gather_tokens: expected runs inside tokens and out, "
                                         r"and arrays of one length$"):
        _native.gather_tokens(tokens, np.array([8], np.int64), np.array([3], np.int64), out,
                              np.array([0], np.int64))
    with pytest.raises(ValueError, match=r"^gather_tokens: expected runs inside tokens and out"):
        _native.gather_tokens(tokens, one, np.array([2], np.int64), out, np.array([3], np.int64))
    with pytest.raises(TypeError, match=r"^counts: expected a 1-D array of int64, found format "
                                        r"[LQ] with 1 dimensions$"):
        _native.gather_tokens(tokens, one, np.array([1], np.uint64), out, one)
    assert out.tolist() == [0, 0, 0, 0]  # nothing written by a refused call


def test_read_nowait_keeps_to_what_the_pipe_holds() -> None:
    reader, writer = os.pipe()
    try:
        os.set_blocking(reader, False)
        assert _native.read_nowait(reader, 16) == b""  # empty: no wait
        os.write(writer, b"abcdef")
        assert _native.read_nowait(reader, 4) == b"abcd"
        assert _native.read_nowait(reader, 16) == b"ef"
        os.close(writer)
        writer = -1
        assert _native.read_nowait(reader, 16) is None  # every writer gone
    finally:
        os.close(reader)
        if writer >= 0:
            os.close(writer)
