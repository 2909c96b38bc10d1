"""`IndexedDataset`: Megatron's `.bin`/`.idx` token files, read through memory maps.

The `.idx` layout (little-endian), byte for byte as megatron-core writes it:

```
offset 0   magic            9 bytes  b"MMIDIDX\\x00\\x00"
       9   version          u64      1
      17   dtype code       u8       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                     6 float64, 7 float32, 8 uint16
      18   num_sequences    u64      N
      26   num_documents    u64      D (entries of document_indices, so one more than documents)
      34   sequence_lengths int32[N] tokens per sequence
           sequence_pointers int64[N] byte offset of each sequence in the `.bin`
           document_indices int64[D] sequence index where each document starts; the last is N
           sequence_modes   int8[N]  only in multimodal files
```

The `.bin` holds the tokens of every sequence back to back. Nothing is read until touched: both
files are mapped, and every array here is a view of a map.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from asynctron.errors import CorruptDatasetError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
#: magic (9) + version (8) + dtype code (1) + num_sequences (8) + num_documents (8)
INDEX_HEADER_BYTES = 34

#: Megatron's `DType` enum: code -> numpy dtype of the tokens in the `.bin`.
DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


def dtype_code(dtype: Any) -> int:
    """Megatron's code for a token dtype (`np.int32` -> 4)."""
    code = _CODE_OF.get(np.dtype(dtype))
    if code is None:
        raise ValueError(f"token dtype {np.dtype(dtype).name!r}: expected one of "
                         f"{sorted(d.name for d in _CODE_OF)}, found none; choose a listed dtype")
    return code


def optimal_dtype(vocab_size: int | None) -> np.dtype[Any]:
    """The token dtype megatron's preprocessing picks: uint16 below 65500 tokens, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


@dataclass(frozen=True, slots=True)
class IndexHeader:
    """The fixed part of an `.idx` file, checked against the file's size."""

    dtype: np.dtype[Any]
    num_sequences: int
    num_documents: int
    has_modes: bool

    @property
    def sequence_lengths_offset(self) -> int:
        return INDEX_HEADER_BYTES

    @property
    def sequence_pointers_offset(self) -> int:
        return INDEX_HEADER_BYTES + 4 * self.num_sequences

    @property
    def document_indices_offset(self) -> int:
        return INDEX_HEADER_BYTES + 12 * self.num_sequences

    @property
    def sequence_modes_offset(self) -> int:
        return self.document_indices_offset + 8 * self.num_documents


def read_index_header(path: str, *, multimodal: bool = False) -> IndexHeader:
    """Parse and check the header of the `.idx` file at `path`.

    Raises:
        FileNotFoundError: no file at `path`.
        CorruptDatasetError: wrong magic, version or dtype code, or a size that does not
            match the header (truncated, or trailing bytes).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(INDEX_HEADER_BYTES)
    if len(head) < INDEX_HEADER_BYTES:
        raise CorruptDatasetError(
            f"index {path}: expected at least {INDEX_HEADER_BYTES} header bytes, found {size}; "
            "the file is truncated, rebuild it", path=path, offset=len(head))
    if head[:9] != INDEX_MAGIC:
        raise CorruptDatasetError(
            f"index {path}: expected magic {INDEX_MAGIC!r}, found {head[:9]!r}; this is not a "
            "megatron .idx file", path=path, offset=0)
    version, code, num_sequences, num_documents = struct.unpack("<QBQQ", head[9:])
    if version != INDEX_VERSION:
        raise CorruptDatasetError(
            f"index {path}: expected version {INDEX_VERSION}, found {version}; this .idx "
            "format is not supported", path=path, offset=9)
    if code not in DTYPE_CODES:
        raise CorruptDatasetError(
            f"index {path}: expected a dtype code in {sorted(DTYPE_CODES)}, found {code}; the "
            "file is corrupt", path=path, offset=17)
    header = IndexHeader(DTYPE_CODES[code], num_sequences, num_documents, has_modes=False)
    plain = header.sequence_modes_offset
    with_modes = plain + num_sequences
    if size not in (plain, with_modes):
        state = "truncated" if size < plain else "followed by unexpected bytes"
        raise CorruptDatasetError(
            f"index {path}: expected {plain} bytes ({with_modes} with sequence modes) for "
            f"{num_sequences} sequences and {num_documents} document indices, found {size}; "
            f"the file is {state}, rebuild it", path=path, offset=min(size, plain))
    if multimodal and size != with_modes:
        raise CorruptDatasetError(
            f"index {path}: expected sequence modes ({with_modes} bytes) for a multimodal "
            f"dataset, found {size} bytes; open it with multimodal=False", path=path,
            offset=plain)
    return IndexHeader(header.dtype, num_sequences, num_documents,
                       has_modes=size == with_modes and num_sequences > 0)


def _map_file(path: str) -> mmap.mmap | bytes:
    """A read-only map of the whole file (`b""` for an empty file, which cannot be mapped)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class IndexedDataset:
    """The sequences of a megatron `.bin`/`.idx` pair, mapped, never copied.

    `ds[i]` is sequence `i` as a read-only numpy array (a view of the map); `ds[a:b]` a list of
    them; `ds.get(i, offset, length)` a part of one. With `multimodal=True`, each of these also
    returns the sequence mode(s), as megatron-core's `IndexedDataset` does.

    Args:
        path_prefix: the files are `path_prefix + ".idx"` and `path_prefix + ".bin"`.
        multimodal: read the per-sequence modes (the `.idx` must have them).

    Raises:
        FileNotFoundError: a file is missing.
        CorruptDatasetError: the `.idx` is malformed, or the `.bin` is not the size it names.

    Memory: two maps and O(1) Python objects; the page cache holds what was touched.
    Concurrency: reads are thread-safe; pickling reopens the files (for DataLoader workers).
    """

    def __init__(self, path_prefix: str, *, multimodal: bool = False) -> None:
        self._open(os.fspath(path_prefix), multimodal)

    def _open(self, path_prefix: str, multimodal: bool) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.idx_path = idx_path(path_prefix)
        self.bin_path = bin_path(path_prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"dataset {path_prefix}: expected {path}, found no such file; check the "
                    "path prefix (without .bin/.idx)")
        header = read_index_header(self.idx_path, multimodal=multimodal)
        self.header = header
        self.dtype = header.dtype
        self._idx_map = _map_file(self.idx_path)
        n, d = header.num_sequences, header.num_documents
        self.sequence_lengths = np.frombuffer(self._idx_map, np.int32, n,
                                              header.sequence_lengths_offset)
        self.sequence_pointers = np.frombuffer(self._idx_map, np.int64, n,
                                               header.sequence_pointers_offset)
        self.document_indices = np.frombuffer(self._idx_map, np.int64, d,
                                              header.document_indices_offset)
        self.sequence_modes = (np.frombuffer(self._idx_map, np.int8, n,
                                             header.sequence_modes_offset)
                               if multimodal else None)
        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            found = self.document_indices[[0, -1]].tolist() if d else "none"
            raise CorruptDatasetError(
                f"index {self.idx_path}: expected document indices from 0 to {n}, found "
                f"{found}; the file is corrupt, rebuild it", path=self.idx_path,
                offset=header.document_indices_offset)
        bin_bytes = os.path.getsize(self.bin_path)
        expected = (int(self.sequence_pointers[-1])
                    + int(self.sequence_lengths[-1]) * self.dtype.itemsize) if n else 0
        if bin_bytes != expected:
            raise CorruptDatasetError(
                f"data {self.bin_path}: expected {expected} bytes (from {self.idx_path}), found "
                f"{bin_bytes}; the .bin is {'truncated' if bin_bytes < expected else 'too long'}"
                " or belongs to another .idx", path=self.bin_path,
                offset=min(bin_bytes, expected))
        self._bin_map = _map_file(self.bin_path)
        self._itemsize = self.dtype.itemsize
        #: every token of the `.bin` as one read-only array (a view of the map)
        self.tokens = np.frombuffer(self._bin_map, self.dtype)

    def __getstate__(self) -> tuple[str, bool]:
        return self.path_prefix, self.multimodal

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self._open(*state)

    def __len__(self) -> int:
        return self.header.num_sequences

    @property
    def num_documents(self) -> int:
        """Documents in the dataset (`len(document_indices) - 1`)."""
        return self.header.num_documents - 1

    def _read(self, pointer: int, count: int) -> np.ndarray:
        return np.frombuffer(self._bin_map, self.dtype, count, pointer)

    def __getitem__(self, idx: int | np.integer | slice) -> Any:
        if isinstance(idx, int | np.integer):
            i = int(idx)
            tokens = self._read(int(self.sequence_pointers[i]), int(self.sequence_lengths[i]))
            return (tokens, self.sequence_modes[i]) if self.sequence_modes is not None else tokens
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slice {idx!r}: expected step 1, found {step}; slices of an "
                                 "IndexedDataset must be contiguous")
            lengths = self.sequence_lengths[start:stop]
            total = int(lengths.sum(dtype=np.int64))
            tokens = self._read(int(self.sequence_pointers[start]), total) if total else (
                np.empty(0, self.dtype))
            parts = np.split(tokens, np.cumsum(lengths[:-1], dtype=np.int64))
            if stop <= start:
                parts = []
            if self.sequence_modes is not None:
                return parts, self.sequence_modes[start:stop]
            return parts
        raise TypeError(f"index {idx!r}: expected an int or a slice, found {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> Any:
        """Tokens `offset : offset + length` of sequence `idx` (to its end when `length` is
        None), as megatron-core's `IndexedDataset.get`."""
        i = int(idx)
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        tokens = self._read(int(self.sequence_pointers[i]) + offset * self._itemsize, int(length))
        return (tokens, self.sequence_modes[i]) if self.sequence_modes is not None else tokens

    def byte_range(self, idx: int, offset: int = 0, length: int | None = None) -> tuple[int, int]:
        """`(start, nbytes)` in the `.bin` of what `get(idx, offset, length)` reads."""
        i = int(idx)
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        return (int(self.sequence_pointers[i]) + offset * self._itemsize,
                int(length) * self._itemsize)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return (f"<IndexedDataset {self.path_prefix!r}: {len(self)} sequences, "
                f"{self.num_documents} documents, {self.dtype.name}>")

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both `path_prefix.idx` and `path_prefix.bin` exist."""
        return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))
