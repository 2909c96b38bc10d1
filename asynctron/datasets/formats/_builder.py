"""`IndexedDatasetBuilder`: writes a megatron `.bin`/`.idx` pair in one pass, in bounded memory.

Tokens stream into the `.bin`, a new file of the storage backend (`open_new_file`), invisible
until `finalize` publishes it. The per-sequence index (lengths, modes) and the document
boundaries go to anonymous spill files in chunks of `_CHUNK` entries, so the builder holds
O(chunk) memory however large the corpus (megatron-core keeps Python lists of every length until
`finalize`). The spill files are the builder's scratch memory, not the dataset's storage: local
files beside the `.bin`. `finalize` publishes the `.bin`, then streams the spill files into the
`.idx` (`publish_file`), computing the pointers as it goes: a published `.idx` means its `.bin`
is whole, also after a crash.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from asynctron.datasets.formats._indexed import (
    INDEX_MAGIC,
    INDEX_VERSION,
    IndexedDataset,
    bin_path,
    dtype_code,
    idx_path,
)
from asynctron.datasets.object_cache._object_storage import is_object_storage_path
from asynctron.storage.backends import backend_for

_CHUNK = 1 << 16
_COPY_BYTES = 16 << 20


class _Spill:
    """An append-only array of one dtype, buffered in memory and spilled to an unnamed file."""

    def __init__(self, dtype: Any, directory: str | None) -> None:
        self.dtype = np.dtype(dtype)
        self._file: IO[bytes] = tempfile.TemporaryFile(  # noqa: SIM115 - closed by close()
            dir=directory, prefix=".asynctron-spill-")
        self._buffer = np.empty(_CHUNK, self.dtype)
        self._used = 0
        self.count = 0

    def append(self, value: int) -> None:
        self._buffer[self._used] = value
        self._used += 1
        self.count += 1
        if self._used == _CHUNK:
            self._flush()

    def extend(self, values: np.ndarray) -> None:
        values = np.asarray(values, self.dtype)
        if self._used + values.size <= _CHUNK:
            self._buffer[self._used:self._used + values.size] = values
            self._used += values.size
            self.count += values.size
            return
        self._flush()
        self._file.write(values.tobytes())
        self.count += values.size

    def _flush(self) -> None:
        self._file.write(self._buffer[:self._used].tobytes())
        self._used = 0

    def chunks(self) -> Any:
        """Yield the whole array, in order, chunk by chunk."""
        self._flush()
        self._file.seek(0)
        step = _CHUNK * self.dtype.itemsize * 16
        while block := self._file.read(step):
            yield np.frombuffer(block, self.dtype)

    def close(self) -> None:
        self._file.close()


class IndexedDatasetBuilder:
    """Writes sequences to `bin_path`; `finalize(idx_path)` writes the index megatron reads.

    Same calls as megatron-core's builder: `add_item` + `end_document`, `add_document`,
    `add_index` (append a whole existing dataset) and `finalize`. Until `finalize` nothing is
    published: an existing `.bin` stays as it was. Use it as a context manager: an error in the
    block aborts (`abort`: nothing is left at `bin_path`); leaving it without `finalize`
    discards what was written.

    Args:
        bin_path: the `.bin` file to write (replaced when `finalize` publishes it).
        dtype: token dtype, one of megatron's codes (`optimal_dtype(vocab_size)` picks one).
        multimodal: also record a mode (int8) per sequence.

    Raises:
        ValueError: `bin_path` is a URL no storage backend serves, or a bad dtype.

    Memory: O(64 Ki entries) for the index, whatever the corpus size, and the `.bin`'s write
    buffer (16 MiB on a local filesystem).
    Concurrency: one thread at a time; every call blocks on file I/O.
    """

    def __init__(self, bin_path: str, dtype: Any = np.int32, multimodal: bool = False) -> None:
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)  # reject a dtype megatron cannot name, before creating files
        self.bin_path = os.fspath(bin_path)
        self.multimodal = multimodal
        self._backend = backend_for(self.bin_path)
        self._data = self._backend.open_new_file(self.bin_path)  # makes the directory
        directory = (None if is_object_storage_path(self.bin_path)  # spills: local temp dir
                     else os.path.dirname(os.path.abspath(self.bin_path)))
        try:
            self._lengths = _Spill(np.int32, directory)
            self._documents = _Spill(np.int64, directory)
            self._modes = _Spill(np.int8, directory) if multimodal else None
        except BaseException:
            self._data.close()
            raise
        self._documents.append(0)
        self._finalized = False

    @property
    def num_sequences(self) -> int:
        return self._lengths.count

    @property
    def num_documents(self) -> int:
        return self._documents.count - 1

    def _tokens(self, tokens: Any) -> np.ndarray:
        if hasattr(tokens, "numpy"):  # a torch tensor
            tokens = tokens.detach().cpu().numpy()
        return np.ascontiguousarray(tokens, dtype=self.dtype).reshape(-1)

    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Append one sequence (a tensor, array or list of token ids)."""
        array = self._tokens(tokens)
        self._data.write(array.data)
        self._lengths.append(array.size)
        if self._modes is not None:
            self._modes.append(mode)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last one form it."""
        self._documents.append(self._lengths.count)

    def add_document(self, tokens: Any, lengths: Sequence[int],
                     modes: Sequence[int] | None = None) -> None:
        """Append one document made of sequences of `lengths` tokens, back to back in `tokens`."""
        array = self._tokens(tokens)
        lengths_array = np.asarray(lengths, np.int64)
        if int(lengths_array.sum()) != array.size:
            raise ValueError(f"document lengths: expected them to sum to the {array.size} tokens "
                             f"given, found {int(lengths_array.sum())}; pass one length per "
                             "sequence")
        self._data.write(array.data)
        self._lengths.extend(lengths_array)
        self._documents.append(self._lengths.count)
        if self._modes is not None:
            self._modes.extend(np.zeros(len(lengths_array), np.int8) if modes is None
                               else np.asarray(modes, np.int8))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of the dataset at `path_prefix` (same dtype)."""
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if other.dtype != self.dtype:
            raise ValueError(f"dataset {path_prefix}: expected dtype {self.dtype.name}, found "
                             f"{other.dtype.name}; merge datasets of one token dtype")
        offset = self._lengths.count
        for start in range(0, len(other), _CHUNK * 16):
            self._lengths.extend(other.sequence_lengths[start:start + _CHUNK * 16])
            if self._modes is not None and other.sequence_modes is not None:
                self._modes.extend(other.sequence_modes[start:start + _CHUNK * 16])
        documents = other.document_indices
        for start in range(1, len(documents), _CHUNK * 16):
            self._documents.extend(documents[start:start + _CHUNK * 16] + offset)
        with backend_for(other.bin_path).open_file(other.bin_path) as source:
            offset = 0
            while chunk := source.pread(_COPY_BYTES, offset):
                self._data.write(chunk)
                offset += len(chunk)

    def finalize(self, idx_path: str) -> None:
        """Publish the `.bin`, then write and publish the `.idx`, each durably: a published
        `.idx` means its `.bin` is whole."""
        try:
            self._data.publish()
            backend_for(idx_path).publish_file(idx_path, self._write_index)
        finally:
            self._close_spills()
        self._finalized = True

    def _write_index(self, out: IO[bytes]) -> None:
        out.write(INDEX_MAGIC)
        out.write(struct.pack("<QBQQ", INDEX_VERSION, dtype_code(self.dtype),
                              self._lengths.count, self._documents.count))
        for chunk in self._lengths.chunks():
            out.write(chunk.data)
        pointer = 0
        for chunk in self._lengths.chunks():  # pointers: running byte offsets of the sequences
            ends = np.cumsum(chunk, dtype=np.int64)
            ends *= self.dtype.itemsize
            ends += pointer
            starts = np.empty_like(ends)
            starts[0] = pointer
            starts[1:] = ends[:-1]
            pointer = int(ends[-1])
            out.write(starts.data)
        for chunk in self._documents.chunks():
            out.write(chunk.data)
        if self._modes is not None:
            for chunk in self._modes.chunks():
                out.write(chunk.data)

    def _close_spills(self) -> None:
        for spill in (self._lengths, self._documents, self._modes):
            if spill is not None:
                spill.close()

    def abort(self) -> None:
        """Close everything, discard the `.bin` being written and remove the one at
        `bin_path` (also after `finalize`)."""
        self._data.close()
        self._close_spills()
        self._backend.remove_file(self.bin_path)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._finalized:
            self._data.close()
            self._close_spills()


def write_indexed_dataset(path_prefix: str, documents: Sequence[Any], dtype: Any = np.int32,
                          ) -> IndexedDataset:
    """Write `documents` (each a token sequence) as one-sequence documents; open the result."""
    with IndexedDatasetBuilder(bin_path(path_prefix), dtype=dtype) as builder:
        for tokens in documents:
            builder.add_item(tokens)
            builder.end_document()
        builder.finalize(idx_path(path_prefix))
    return IndexedDataset(path_prefix)
