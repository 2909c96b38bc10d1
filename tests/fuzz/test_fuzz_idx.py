"""Fuzzing `IndexedDataset`: any `.idx`/`.bin` pair either opens and serves every sequence from
inside the `.bin`, or is refused with CorruptDatasetError; never another exception, never an
allocation the size of what a header claims.

Examples per test: see `conftest.py` (about 100 examples a second).
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asynctron.datasets import IndexedDataset, IndexedDatasetBuilder
from asynctron.datasets.formats._indexed import DTYPE_CODES, INDEX_HEADER_BYTES, INDEX_MAGIC
from asynctron.errors import CorruptDatasetError

#: what opening and reading a file of a few KiB may allocate, whatever its header claims
PEAK_BYTES_LIMIT = 1 << 20

U64 = st.integers(0, 2**64 - 1)
HEADER_FIELDS = {"version": (9, "<Q"), "dtype code": (17, "<B"), "num_sequences": (18, "<Q"),
                 "num_documents": (26, "<Q")}


def _write(directory: str, idx: bytes, data: bytes) -> str:
    prefix = os.path.join(tempfile.mkdtemp(dir=directory), "d")
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "wb") as f:
        f.write(data)
    return prefix


def _check(prefix: str, multimodal: bool) -> None:
    """Open `prefix` and read everything; the property every input must keep."""
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    tracemalloc.start()
    try:
        ds = IndexedDataset(prefix, multimodal=multimodal)
    except CorruptDatasetError as exc:
        assert exc.path in (prefix + ".idx", prefix + ".bin")
        assert str(exc).startswith((f"index {prefix}.idx", f"data {prefix}.bin")), exc
    else:
        _read_everything(ds, data, multimodal)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        shutil.rmtree(os.path.dirname(prefix))
    assert peak < PEAK_BYTES_LIMIT, f"opening and reading allocated {peak} bytes"


def _read_everything(ds: IndexedDataset, data: bytes, multimodal: bool) -> None:
    itemsize = ds.dtype.itemsize
    lengths, pointers = ds.sequence_lengths.tolist(), ds.sequence_pointers.tolist()
    assert ds.document_indices[0] == 0 and ds.document_indices[-1] == len(ds)
    assert np.all(np.diff(ds.document_indices) >= 0)
    for i in range(len(ds)):
        start, nbytes = pointers[i], lengths[i] * itemsize
        assert start >= 0 and nbytes >= 0 and start + nbytes <= len(data)
        expected = data[start:start + nbytes]
        tokens = ds[i][0] if multimodal else ds[i]
        assert tokens.tobytes() == expected
        part = ds.get(i, lengths[i] // 2)
        assert (part[0] if multimodal else part).tobytes() == expected[lengths[i] // 2 * itemsize:]
        assert ds.byte_range(i) == (start, nbytes)
    parts = ds[:]
    parts = parts[0] if multimodal else parts
    assert b"".join(p.tobytes() for p in parts) == data
    middle = ds[len(ds) // 3:2 * len(ds) // 3]
    assert len(middle[0] if multimodal else middle) == 2 * len(ds) // 3 - len(ds) // 3


def _valid_pair(directory: str, documents: list[list[list[int]]], dtype: np.dtype,
                multimodal: bool) -> tuple[bytes, bytes]:
    """The `.idx` and `.bin` bytes the builder writes for `documents` (lists of sequences)."""
    prefix = os.path.join(tempfile.mkdtemp(dir=directory), "v")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for k, sequences in enumerate(documents):
        builder.add_document(np.array([t for s in sequences for t in s], dtype),
                             [len(s) for s in sequences],
                             modes=[k % 3] * len(sequences) if multimodal else None)
    builder.finalize(prefix + ".idx")
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    shutil.rmtree(os.path.dirname(prefix))
    return idx, data


documents_strategy = st.lists(st.lists(st.lists(st.integers(0, 100), max_size=6), max_size=3),
                              max_size=8)
dtypes_strategy = st.sampled_from(sorted(set(DTYPE_CODES.values()), key=str))


@st.composite
def mutations(draw: st.DrawFn, idx: bytes) -> bytes:
    """`idx` with some of: bytes flipped, a header field or an index entry set to any value,
    bytes cut off or appended."""
    out = bytearray(idx)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "header", "entry", "cut", "append"]))
        if kind == "flip" and out:
            at = draw(st.integers(0, len(out) - 1))
            out[at] ^= draw(st.integers(1, 255))
        elif kind == "header" and len(out) >= INDEX_HEADER_BYTES:
            at, fmt = HEADER_FIELDS[draw(st.sampled_from(sorted(HEADER_FIELDS)))]
            small = st.integers(0, 64)
            out[at:at + struct.calcsize(fmt)] = struct.pack(
                fmt, draw(st.integers(0, 255) if fmt == "<B" else st.one_of(small, U64)))
        elif kind == "entry" and len(out) >= INDEX_HEADER_BYTES + 4:
            at = draw(st.integers(INDEX_HEADER_BYTES, len(out) - 4))
            width = 8 if at + 8 <= len(out) and draw(st.booleans()) else 4
            value = draw(st.integers(-(2 ** (8 * width - 1)), 2 ** (8 * width - 1) - 1))
            out[at:at + width] = value.to_bytes(width, "little", signed=True)
        elif kind == "cut":
            del out[draw(st.integers(0, len(out))):]
        elif kind == "append":
            out += draw(st.binary(min_size=1, max_size=24))
    return bytes(out)


@given(data=st.data(), documents=documents_strategy, dtype=dtypes_strategy,
       multimodal=st.booleans(), read_multimodal=st.booleans())
def test_mutated_valid_files(workdir: str, data: st.DataObject, documents: list,
                             dtype: np.dtype, multimodal: bool, read_multimodal: bool) -> None:
    idx, tokens = _valid_pair(workdir, documents, dtype, multimodal)
    idx = data.draw(mutations(idx), label="idx")
    if data.draw(st.booleans(), label="change the .bin"):
        cut = data.draw(st.integers(0, len(tokens)), label="bin cut")
        tokens = tokens[:cut] + data.draw(st.binary(max_size=16), label="bin tail")
    _check(_write(workdir, idx, tokens), read_multimodal)


@st.composite
def random_indices(draw: st.DrawFn) -> bytes:
    """An `.idx` of random bytes, behind a good magic most of the time, often with its header's
    counts matching its size, so the checks after the size check see random entries."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=256))
    version = draw(U64) if draw(st.integers(0, 9)) == 0 else 1
    code = draw(st.integers(0, 255) if draw(st.integers(0, 9)) == 0
                else st.sampled_from(sorted(DTYPE_CODES)))
    num_sequences = draw(st.one_of(st.integers(0, 12), U64))
    num_documents = draw(st.one_of(st.integers(0, 14), U64))
    size = 12 * num_sequences + 8 * num_documents + draw(st.sampled_from([0, num_sequences]))
    body = (draw(st.binary(min_size=size, max_size=size)) if size <= 512
            else draw(st.binary(max_size=64)))
    return INDEX_MAGIC + struct.pack("<QBQQ", version, code, num_sequences, num_documents) + body


@given(idx=random_indices(), tokens=st.binary(max_size=256), multimodal=st.booleans())
def test_random_files(workdir: str, idx: bytes, tokens: bytes, multimodal: bool) -> None:
    _check(_write(workdir, idx, tokens), multimodal)


def test_a_header_claiming_2_to_the_60_sequences_is_refused_by_size(workdir: str) -> None:
    idx = INDEX_MAGIC + struct.pack("<QBQQ", 1, 4, 2**60, 2**60 + 1) + bytes(64)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDatasetError, match=r"for 1152921504606846976 sequences .* "
                                                      r"found 98; the file is truncated"):
            IndexedDataset(_write(workdir, idx, b""))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES_LIMIT
