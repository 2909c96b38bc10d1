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

The `.bin` holds the tokens of every sequence back to back. Both files are read through the
storage backend of their path (`backend_for`): the index whole (`whole_file`: mapped where the
storage maps files), every array here a view of it; the `.bin` mapped (`MappableFiles`) or read
sequence by sequence (`open_file`, `pread`) with `mmap=False`, and on an object store
(`RangedFiles`) through the node-local range cache; opening reads the whole index once to check
it (`IndexedDataset`), the `.bin` only when touched.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from asynctron import _native
from asynctron.datasets.object_cache._object_storage import (
    ObjectStorageConfig,
    cache_path,
    cached_index,
    is_object_storage_path,
    open_object,
)
from asynctron.datasets.object_cache._range_cache import RangeCache
from asynctron.errors import CorruptDatasetError
from asynctron.storage.backends import MappableFiles, backend_for, whole_file

if TYPE_CHECKING:
    from asynctron.storage.backends import ReadableFile

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

#: index entries checked per step: the checks' temporaries are ~11 bytes per entry of one step
#: (~3 MiB); larger steps are no faster (20M sequences: 49 ms at 2**18, 52 at 2**20, 75 at 2**22)
_CHECK_ENTRIES = 1 << 18


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
    with backend_for(path).open_file(path) as f:
        size = f.nbytes
        head = f.pread(INDEX_HEADER_BYTES, 0)
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


def _first_fault(begin: int, end: int,
                 faults: Callable[[int, int], np.ndarray]) -> int | None:
    """The first `i` in `[begin, end)` where `faults(a, b)`, a bool array for entries `a:b`, is
    True, checked `_CHECK_ENTRIES` at a time; None if there is none."""
    for a in range(begin, end, _CHECK_ENTRIES):
        fault = faults(a, min(end, a + _CHECK_ENTRIES))
        if fault.any():
            return a + int(fault.argmax())
    return None


class DatasetIndex:
    """The arrays of an `.idx` file, mapped: megatron-core's `_IndexReader` (what megatron's
    `IndexedDataset.index` is, and what its tools read).

    Args:
        idx_path: the `.idx` file.
        multimodal: map the per-sequence modes too (the file must have them).
        sequences_per_dataset: `(sequence_count, document_count)` the caller expects (from
            megatron's `--per-dataset-sequences-path`); checked against the header.
        dtype_code: the token dtype code the caller expects; checked against the header.

    Raises:
        FileNotFoundError: no file at `idx_path`.
        CorruptDatasetError: a malformed header or size, or counts/dtype other than expected.
    """

    def __init__(self, idx_path: str, multimodal: bool = False,
                 sequences_per_dataset: tuple[int, int] | None = None,
                 dtype_code: int | None = None) -> None:
        header = read_index_header(idx_path, multimodal=multimodal)
        if sequences_per_dataset is not None and tuple(sequences_per_dataset) != (
                header.num_sequences, header.num_documents):
            raise CorruptDatasetError(
                f"index {idx_path}: expected {tuple(sequences_per_dataset)} (sequences, document "
                f"indices) from sequences_per_dataset, found ({header.num_sequences}, "
                f"{header.num_documents}); rebuild the sequences-per-dataset file",
                path=idx_path, offset=18)
        if dtype_code is not None and DTYPE_CODES.get(dtype_code) != header.dtype:
            raise CorruptDatasetError(
                f"index {idx_path}: expected token dtype code {dtype_code}, found "
                f"{_CODE_OF[header.dtype]} ({header.dtype.name}); the tokenizer's vocabulary "
                "does not match this file", path=idx_path, offset=17)
        self.idx_path = idx_path
        self.header = header
        self.dtype = header.dtype
        self.dtype_size = header.dtype.itemsize
        self.sequence_count = header.num_sequences
        self.document_count = header.num_documents
        self._map = whole_file(backend_for(idx_path), idx_path)
        n, d = header.num_sequences, header.num_documents
        self.sequence_lengths = np.frombuffer(self._map, np.int32, n,
                                              header.sequence_lengths_offset)
        self.sequence_pointers = np.frombuffer(self._map, np.int64, n,
                                               header.sequence_pointers_offset)
        self.document_indices = np.frombuffer(self._map, np.int64, d,
                                              header.document_indices_offset)
        self.sequence_modes = (np.frombuffer(self._map, np.int8, n, header.sequence_modes_offset)
                               if multimodal else None)

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> tuple[np.int64, np.int32, np.int8 | None]:
        """`(pointer, length, mode or None)` of sequence `idx`."""
        return (self.sequence_pointers[idx], self.sequence_lengths[idx],
                None if self.sequence_modes is None else self.sequence_modes[idx])


class IndexedDataset:
    """The sequences of a megatron `.bin`/`.idx` pair; megatron-core's constructor and reads.

    `ds[i]` is sequence `i` as a read-only numpy array; `ds[a:b]` a list of them;
    `ds.get(i, offset, length)` a part of one. With `multimodal=True`, each of these also
    returns the sequence mode(s), as megatron-core's `IndexedDataset` does. `ds.index` is the
    `DatasetIndex` (megatron's `_IndexReader`).

    Args:
        path_prefix: the files are `path_prefix + ".idx"` and `path_prefix + ".bin"`.
        multimodal: read the per-sequence modes (the `.idx` must have them).
        mmap: map the `.bin` (reads are views of the map); False reads each sequence with
            one `pread` of the backend's open file (megatron's file reader: no page-table setup
            per touched page, faster for cold random samples).
        object_storage_config, s3_config: for a dataset on object storage (`s3://...`):
            megatron-core's `ObjectStorageConfig` or asynctron's (which adds the cache's
            budget). The `.idx` is fetched once per node into its cache directory; the
            `.bin` is read in ranges through a node-local cache of its blocks
            (`RangeCache`), fetched ahead of the sampler by `AsyncLoader`'s workers.
        fast_cache_load: megatron's flag; accepted (the files are opened and checked anyway).
        sequences_per_dataset, dtype_code: what the caller expects of the header; checked.

    Raises:
        FileNotFoundError: a file is missing.
        CorruptDatasetError: the `.idx` is malformed (header, size, a document index out of
            order, a negative length, a pointer not where the sequence before it ends), or the
            `.bin` is not the size it names; the message names the file, the entry and its value.
            So every sequence an opened dataset serves lies inside the `.bin`.
        StorageError: the object store failed past its deadline (naming the object).
        ValueError: `path_prefix` is a URL no storage backend serves; an object-storage path
            without `object_storage_config` or with `mmap=True`.

    Memory: maps and O(1) Python objects; the page cache holds what was touched. Opening
    reads the whole `.idx` once to check it (2.5 ms per million sequences from the page cache,
    plus reading the file when it is not cached), with ~3 MiB of temporaries.
    Concurrency: reads are thread-safe; pickling reopens the files (for DataLoader workers).
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True,
                 object_storage_config: Any = None, s3_config: Any = None,
                 fast_cache_load: bool = False,
                 sequences_per_dataset: tuple[int, int] | None = None,
                 dtype_code: int | None = None) -> None:
        path_prefix = os.fspath(path_prefix)
        config = object_storage_config if object_storage_config is not None else s3_config
        storage = None
        if is_object_storage_path(path_prefix):
            if config is None:
                raise ValueError(
                    f"dataset {path_prefix}: expected object_storage_config="
                    "ObjectStorageConfig(path_to_idx_cache=<a local directory>) for a dataset "
                    "on object storage, found none")
            if mmap:
                raise ValueError(f"dataset {path_prefix}: object storage cannot be mapped; "
                                 "pass mmap=False (as megatron-core requires)")
            storage = ObjectStorageConfig.of(config)
        elif config is not None:
            raise ValueError(f"dataset {path_prefix}: object_storage_config is for s3:// "
                             "paths, found a local path; drop it or pass the s3:// URL")
        self._open((path_prefix, multimodal, mmap, fast_cache_load, sequences_per_dataset,
                    dtype_code, storage))

    def _open(self, state: tuple[str, bool, bool, bool, tuple[int, int] | None, int | None,
                                 ObjectStorageConfig | None]) -> None:
        (path_prefix, multimodal, use_mmap, self.fast_cache_load, self.sequences_per_dataset,
         self.dtype_code, self.object_storage_config) = state
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = use_mmap
        self.idx_path = idx_path(path_prefix)
        self.bin_path = bin_path(path_prefix)
        backend = backend_for(path_prefix)
        storage = self.object_storage_config
        #: the `.bin`'s node-local cache (a dataset on object storage), else None
        self._ranges: RangeCache | None = None
        try:
            local_idx = (self.idx_path if storage is None
                         else cached_index(self.idx_path, storage.path_to_idx_cache))
            self.index = DatasetIndex(local_idx, multimodal, self.sequences_per_dataset,
                                      self.dtype_code)
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise self._missing(self.idx_path, exc) from exc
        try:
            if use_mmap:
                if not isinstance(backend, MappableFiles):
                    raise ValueError(f"dataset {path_prefix}: mmap=True maps local files, and "
                                     f"{type(backend).__name__} does not map; pass mmap=False")
                self._bin_map = backend.map_file(self.bin_path)
                bin_bytes = len(self._bin_map)
            else:
                #: the `.bin` opened for `pread` (`mmap=False`; on an object store, through the
                #: node-local range cache), else None
                self._bin_file: ReadableFile | None = (
                    backend.open_file(self.bin_path) if storage is None
                    else self._cached_bin(storage))
                self._pread = self._bin_file.pread  # bound once: one call per read
                bin_bytes = self._bin_file.nbytes
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise self._missing(self.bin_path, exc) from exc
        self.header = self.index.header
        self.dtype = self.index.dtype
        self.sequence_lengths = self.index.sequence_lengths
        self.sequence_pointers = self.index.sequence_pointers
        self.document_indices = self.index.document_indices
        self.sequence_modes = self.index.sequence_modes
        self._check_document_indices()
        self._check_sequences(bin_bytes)
        self._itemsize = self.dtype.itemsize
        if use_mmap:
            #: every token of the `.bin` as one read-only array (a view of the map); None
            #: when reading with pread (`mmap=False`)
            self.tokens: np.ndarray | None = np.frombuffer(self._bin_map, self.dtype)
            self._bin_file = None
        else:
            self.tokens = None

    def _cached_bin(self, storage: ObjectStorageConfig) -> RangeCache:
        """The `.bin` object read through the node-local range cache under the index cache."""
        directory = storage.path_to_idx_cache
        source = open_object(self.bin_path)
        self._ranges = RangeCache(source, cache_path(self.bin_path, directory), directory,
                                  budget_bytes=storage.cache_budget_bytes,
                                  block_bytes=storage.block_bytes_for(source.nbytes),
                                  request_bytes=storage.request_bytes)
        return self._ranges

    def __del__(self) -> None:
        if getattr(self, "_bin_file", None) is not None:
            self._bin_file.close()

    def _missing(self, path: str, cause: OSError) -> FileNotFoundError:
        found = f"found no such file ({cause})" if is_object_storage_path(path) else (
            "found no such file")
        return FileNotFoundError(f"dataset {self.path_prefix}: expected {path}, {found}; check "
                                 "the path prefix (without .bin/.idx)")

    def _corrupt(self, what: str, offset: int) -> CorruptDatasetError:
        return CorruptDatasetError(
            f"index {self.idx_path}, {what}; the file is corrupt, rebuild it",
            path=self.idx_path, offset=offset)

    def _check_document_indices(self) -> None:
        """Raise CorruptDatasetError at the first document index that breaks `0 = first <= ...
        <= last = N` (N sequences)."""
        n, indices = self.header.num_sequences, self.document_indices
        base = self.header.document_indices_offset
        if indices.size == 0:
            raise self._corrupt(f"document indices: expected at least one (the last is {n}), "
                                "found none", base)
        if indices[0] != 0:
            raise self._corrupt(f"document index 0: expected 0, found {int(indices[0])}", base)
        j = _first_fault(1, indices.size, lambda a, b: (indices[a:b] > n)
                         | (indices[a:b] < indices[a - 1:b - 1]))
        if j is not None:
            value, previous = int(indices[j]), int(indices[j - 1])
            expected = (f"a sequence index <= {n}" if value > n
                        else f">= {previous} (document index {j - 1})")
            raise self._corrupt(f"document index {j}: expected {expected}, found {value}",
                                base + 8 * j)
        if indices[-1] != n:
            raise self._corrupt(f"document index {indices.size - 1} (the last): expected {n} "
                                f"(the number of sequences), found {int(indices[-1])}",
                                base + 8 * (indices.size - 1))

    def _check_sequences(self, bin_bytes: int) -> None:
        """Raise CorruptDatasetError unless the sequences tile the `.bin` exactly: every length
        >= 0, the first pointer 0, each next pointer where the sequence before it ends, the last
        ending at the `.bin`'s end (as megatron-core writes them, and as slices read them)."""
        lengths, pointers, itemsize = self.sequence_lengths, self.sequence_pointers, (
            self.dtype.itemsize)

        def start_of(i: int) -> int:  # where sequence i starts if the ones before it are sound
            return int(pointers[i - 1]) + int(lengths[i - 1]) * itemsize if i else 0

        def faults(a: int, b: int) -> np.ndarray:
            start = start_of(a)  # <= bin_bytes: the steps before passed
            ends = lengths[a:b].astype(np.int64)
            ends *= itemsize
            np.cumsum(ends, out=ends)  # |sum| < 2**18 * 2**31 * 8: no int64 overflow
            ends += start
            fault = lengths[a:b] < 0
            fault |= ends > bin_bytes
            fault[0] |= pointers[a] != start
            fault[1:] |= pointers[a + 1:b] != ends[:-1]
            return fault

        i = _first_fault(0, len(lengths), faults)
        if i is not None:
            length, pointer, start = int(lengths[i]), int(pointers[i]), start_of(i)
            if length < 0:
                raise self._corrupt(f"sequence {i}: expected a length >= 0, found {length}",
                                    self.header.sequence_lengths_offset + 4 * i)
            if pointer != start:
                after = (f"where sequence {i - 1} ends: pointer {int(pointers[i - 1])}, "
                         f"length {int(lengths[i - 1])}" if i else "the start of the .bin")
                outside = ("" if 0 <= pointer <= bin_bytes
                           else f", outside the {bin_bytes}-byte {self.bin_path}")
                raise self._corrupt(f"sequence {i}: expected pointer {start} ({after}), found "
                                    f"{pointer}{outside}",
                                    self.header.sequence_pointers_offset + 8 * i)
            raise CorruptDatasetError(
                f"data {self.bin_path}: expected at least {pointer + length * itemsize} bytes "
                f"(sequence {i} of {self.idx_path} ends there: pointer {pointer}, length "
                f"{length}), found {bin_bytes}; the .bin is truncated or belongs to another .idx",
                path=self.bin_path, offset=bin_bytes)
        end = start_of(len(lengths))
        if end != bin_bytes:
            raise CorruptDatasetError(
                f"data {self.bin_path}: expected {end} bytes (from {self.idx_path}), found "
                f"{bin_bytes}; the .bin is too long or belongs to another .idx",
                path=self.bin_path, offset=end)

    def __getstate__(self) -> tuple[str, bool, bool, bool, tuple[int, int] | None, int | None,
                                    ObjectStorageConfig | None]:
        return (self.path_prefix, self.multimodal, self.mmap, self.fast_cache_load,
                self.sequences_per_dataset, self.dtype_code, self.object_storage_config)

    def __setstate__(self, state: tuple[str, bool, bool, bool, tuple[int, int] | None,
                                        int | None, ObjectStorageConfig | None]) -> None:
        self._open(state)

    def __len__(self) -> int:
        return self.header.num_sequences

    @property
    def num_documents(self) -> int:
        """Documents in the dataset (`len(document_indices) - 1`)."""
        return self.header.num_documents - 1

    def _read(self, pointer: int, count: int) -> np.ndarray:
        if self.tokens is not None:
            return np.frombuffer(self._bin_map, self.dtype, count, pointer)
        data = self._pread(count * self._itemsize, pointer)
        return np.frombuffer(data, self.dtype, count)

    def gather(self, starts: np.ndarray, counts: np.ndarray, out: np.ndarray,
               destinations: np.ndarray) -> None:
        """For each run `i`, write tokens `starts[i] : starts[i] + counts[i]` of the `.bin`
        (token positions) as int64 to the flat `out`, from element `destinations[i]` on."""
        if self.tokens is not None:
            _native.gather_tokens(self.tokens, starts, counts, out, destinations)
            return
        if self._ranges is not None:
            self._ranges.gather(self.dtype, starts, counts, out, destinations)
            return
        flat = out.reshape(-1)
        for start, count, destination in zip(starts.tolist(), counts.tolist(),
                                             destinations.tolist(), strict=True):
            flat[destination:destination + count] = self._read(start * self._itemsize, count)

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

    def fetch_ahead(self, starts: np.ndarray, counts: np.ndarray) -> None:
        """Start fetching tokens `starts[i] : starts[i] + counts[i]` (token positions) into
        the local cache of a dataset on object storage; returns at once. Local files: a
        no-op (their pages are advised instead)."""
        if self._ranges is not None:
            self._ranges.prefetch(starts * self._itemsize, counts * self._itemsize)

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
        """Whether both `path_prefix.idx` and `path_prefix.bin` exist (as files that open)."""
        for path in (idx_path(path_prefix), bin_path(path_prefix)):
            try:
                backend_for(path).open_file(path).close()
            except (FileNotFoundError, IsADirectoryError):
                return False
        return True
