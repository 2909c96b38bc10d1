"""torch.distributed.checkpoint's own on-disk format: reading stock DCP checkpoints without
unpickling anything but DCP's metadata types, and what writing it (`format="dcp"`) needs.

A DCP checkpoint is a directory holding a pickled `.metadata` (a `Metadata`: per key, its
tensor chunks or a bytes entry; per stored item, its file, offset and length; the mapping of
flattened keys back to nested paths) and `__<rank>_<n>.distcp` files whose tensor items are
`torch.save` blobs and whose bytes items are `torch.save`d Python values.

Reading it never runs foreign code: `.metadata` goes through `MetadataUnpickler`, which admits
only DCP's metadata classes, torch dtypes and `torch.Size` (any other global is a
`CorruptCheckpointError` naming it), and item blobs go through `torch.load(weights_only=True)`
(tensors, containers and numpy arrays only). The result is an ordinary `Manifest` whose items
say `encoding="torch_save"`, so the engine's loader reads both formats.

Writing: a `torch.save` blob of a contiguous tensor is a constant prefix, the raw bytes and a
constant suffix, given the dtype and shape (`torch_save_frame`), so asynctron's pipeline writes
DCP's files at its own speed: frames around raw bodies, plus `metadata_bytes`.
"""

from __future__ import annotations

import functools
import io
import itertools
import os
import pickle
import re
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asynctron.errors import CorruptCheckpointError
from asynctron.storage import _sysio
from asynctron.storage._dtypes import TORCH_DTYPES, dtype_name
from asynctron.storage._manifest import ItemRecord, Manifest, check_chunks, is_count
from asynctron.storage._plan import Structure

METADATA_NAME = ".metadata"
#: A `.metadata` larger than this is refused before unpickling.
MAX_METADATA_BYTES = 512 << 20
_DATA_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")

_DCP_METADATA_TYPES = frozenset({
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                 "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata`, admitting only DCP's metadata types and torch dtypes."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_TYPES or (module == "torch" and name in TORCH_DTYPES):
            return super().find_class(module, name)
        raise CorruptCheckpointError(
            f"metadata {self._path}: expected only DCP metadata types, found global "
            f"{module}.{name}; refusing to unpickle it", path=self._path)


def is_dcp_checkpoint(path: str) -> bool:
    return _sysio.is_file(os.path.join(path, METADATA_NAME))


def read_dcp_manifest(checkpoint: str) -> Manifest:
    """Blocks: read a stock DCP checkpoint's `.metadata` as a `Manifest` (no checksums; items
    are `torch.save` blobs).

    Raises:
        CorruptCheckpointError: a foreign global in the pickle, a malformed `Metadata`, an item
            outside its file or a missing file, naming the field at fault.
    """
    path = os.path.join(checkpoint, METADATA_NAME)

    def fail(what: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"metadata {path}: {what}; the checkpoint is damaged or "
                                      "not a torch.distributed.checkpoint checkpoint",
                                      path=path, key=key)

    raw = _sysio.read_small_file(path, MAX_METADATA_BYTES)
    try:
        metadata = MetadataUnpickler(raw, path).load()
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        raise fail(f"expected a pickled Metadata, found {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata) or not isinstance(
            metadata.state_dict_metadata, Mapping) or not isinstance(
            metadata.storage_data, Mapping):
        raise fail(f"expected a Metadata with state_dict_metadata and storage_data, found "
                   f"{type(metadata).__name__}")
    files: dict[str, int] = {}
    items = []
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise fail(f"storage entry {index!r}: expected MetadataIndex -> _StorageInfo")
        key = index.fqn
        if not isinstance(key, str) or "\x00" in key:
            raise fail(f"item key {key!r}: expected a string without NUL")
        name = info.relative_path
        if not isinstance(name, str) or not _DATA_FILE.fullmatch(name) or name == METADATA_NAME:
            raise fail(f"item {key!r} file {name!r}: expected a file name inside the "
                       "checkpoint", key)
        if info.transform_descriptors:
            raise fail(f"item {key!r}: expected no stream transforms, found "
                       f"{list(info.transform_descriptors)!r}", key)
        if name not in files:
            file_path = os.path.join(checkpoint, name)
            if not _sysio.exists(file_path):
                raise CorruptCheckpointError(
                    f"file {file_path}: expected a data file, found none; the checkpoint lost "
                    "a file", path=file_path, key=key)
            files[name] = _sysio.data_file_size(file_path)
        offset, length = info.offset, info.length
        if not (is_count(offset) and is_count(length)) or offset + length > files[name]:
            raise fail(f"item {key!r} bytes [{offset!r}, +{length!r}): expected inside {name} "
                       f"({files[name]} bytes)", key)
        items.append(_record(metadata, index, name, offset, length, fail))
    check_chunks(items, fail)
    stored = {item.key for item in items}
    structure = _structure(metadata.planner_data,
                           [key for key in metadata.state_dict_metadata if key in stored])
    return Manifest(structure=structure, items=tuple(items), files=files,
                    created_unix_s=os.path.getmtime(path), checksum=None)


def _record(metadata: Metadata, index: MetadataIndex, file: str, offset: int, length: int,
            fail: Any) -> ItemRecord:
    key = index.fqn
    entry = metadata.state_dict_metadata.get(key)
    if isinstance(entry, BytesStorageMetadata):
        return ItemRecord(key, "object", None, None, None, None, file, offset, length, None,
                          encoding="torch_save")
    if not isinstance(entry, TensorStorageMetadata):
        raise fail(f"item {key!r}: expected tensor or bytes metadata, found "
                   f"{type(entry).__name__}", key)
    try:
        dtype = dtype_name(entry.properties.dtype, key)
    except TypeError as exc:
        raise fail(str(exc), key) from None
    chunk = next((c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset or ())),
                 None)
    if chunk is None:
        raise fail(f"item {key!r} at chunk {list(index.offset or ())}: expected one of the "
                   "key's chunks", key)
    shape, offsets, size = tuple(chunk.sizes), tuple(chunk.offsets), tuple(entry.size)
    if len(shape) != len(size) or any(o + s > g for o, s, g in zip(offsets, shape, size,
                                                                    strict=True)):
        raise fail(f"item {key!r} chunk at {list(offsets)} of shape {list(shape)}: expected "
                   f"inside global shape {list(size)}", key)
    return ItemRecord(key, "tensor", dtype, shape, size, offsets, file, offset, length, None,
                      encoding="torch_save")


def _structure(planner_data: Any, keys: Sequence[str]) -> Structure:
    """The nesting DCP flattened (its planner data maps each key to its path), as a structure;
    a flat dict of keys where the mapping is missing."""
    paths: dict[str, tuple[str | int, ...]] = {}
    if isinstance(planner_data, Mapping):
        for key in dict.fromkeys(keys):
            path = planner_data.get(key)
            if isinstance(path, tuple) and path and all(
                    isinstance(p, str | int) and not isinstance(p, bool) for p in path):
                paths[key] = path
    if len(paths) != len(set(keys)):
        return {"dict": [[key, {"item": key}] for key in dict.fromkeys(keys)]}
    root: dict[str | int, Any] = {}
    for key, path in paths.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = key
    return _encode(root)


def _encode(node: Any) -> Structure:
    if isinstance(node, str):
        return {"item": node}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return {"list": [_encode(node[i]) for i in range(len(node))]}
    return {"dict": [[k, _encode(v)] for k, v in node.items()]}


class _SparseSink(io.RawIOBase):
    """A seekable binary sink that keeps what is written and skips what is seeked over."""

    def __init__(self) -> None:
        super().__init__()
        self.position = 0
        self.parts: list[tuple[int, bytes]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.parts.append((self.position, chunk))
        self.position += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = offset if whence == io.SEEK_SET else self.position + offset
        return self.position

    def tell(self) -> int:
        return self.position


_FRAME_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4096)
def torch_save_frame(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, bytes]:
    """(prefix, suffix) such that prefix + the tensor's raw bytes (C order) + suffix is what
    `torch.save` writes for a contiguous CPU tensor of `shape` and `dtype`, without CRC-32s
    (`torch.load` does not check them). Built with `torch.serialization.skip_data` into a sink
    that skips the data, so no byte of the tensor is touched, whatever its size.

    Thread-safe; torch's CRC option is process-wide, so it is switched off only for the
    moment of the call, under a lock.
    """
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    sink = _SparseSink()
    with _FRAME_LOCK:
        computing_crc = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            with torch.serialization.skip_data():
                torch.save(tensor, sink)
        finally:
            torch.serialization.set_crc32_options(computing_crc)
    parts = sorted(sink.parts)
    holes = [(end, start) for (at, data), (start, _) in itertools.pairwise(parts)
             if (end := at + len(data)) < start]
    if nbytes and len(holes) == 1 and holes[0][1] - holes[0][0] == nbytes:
        data_start = holes[0][0]
    elif not nbytes and not holes:
        data_start = sink.position
    else:
        raise RuntimeError(f"torch.save of {dtype} {list(shape)}: expected one hole of {nbytes} "
                           f"bytes for the data with skip_data, found {holes}; this torch "
                           "version lays out its files differently")
    prefix = b"".join(data for at, data in parts if at < data_start)
    suffix = b"".join(data for at, data in parts if at >= data_start + nbytes)
    assert len(prefix) == data_start and len(prefix) + nbytes + len(suffix) == sink.position
    return prefix, suffix


def metadata_bytes(records: Sequence[ItemRecord], frames: Sequence[tuple[int, int] | None],
                   paths: Mapping[str, tuple[str | int, ...]], checkpoint_id: str) -> bytes:
    """A DCP `.metadata` (pickled `Metadata`) for items laid out in DCP's format: each tensor
    record is the raw body of a `torch.save` blob whose frame lengths `frames` gives; each
    object record is a whole blob. `paths` maps keys to their nested paths (DCP's planner data,
    so stock `dcp.load` fills a nested state dict)."""
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    for record, frame in zip(records, frames, strict=True):
        if record.kind == "object":
            state_dict_metadata[record.key] = BytesStorageMetadata()
            storage_data[MetadataIndex(record.key)] = _StorageInfo(record.file, record.offset,
                                                                   record.nbytes)
            continue
        assert frame is not None and record.dtype is not None
        assert record.shape is not None and record.global_shape is not None
        assert record.chunk_offsets is not None
        entry = state_dict_metadata.setdefault(record.key, TensorStorageMetadata(
            properties=TensorProperties(dtype=TORCH_DTYPES[record.dtype]),
            size=torch.Size(record.global_shape), chunks=[]))
        assert isinstance(entry, TensorStorageMetadata)
        chunk = ChunkStorageMetadata(offsets=torch.Size(record.chunk_offsets),
                                     sizes=torch.Size(record.shape))
        entry.chunks.append(chunk)
        head, tail = frame
        storage_data[MetadataIndex(record.key, chunk.offsets, len(entry.chunks) - 1)] = (
            _StorageInfo(record.file, record.offset - head, head + record.nbytes + tail))
    metadata = Metadata(state_dict_metadata=state_dict_metadata, planner_data=dict(paths),
                        storage_data=storage_data,
                        storage_meta=StorageMeta(checkpoint_id=checkpoint_id,
                                                 save_id=uuid.uuid4().hex),
                        version=CURRENT_DCP_VERSION)
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


_NUMPY_GLOBALS = [np.ndarray, np.dtype, np._core.multiarray._reconstruct] + [
    type(np.dtype(name)) for name in ("float64", "float32", "float16", "int64", "int32", "int16",
                                      "int8", "uint8", "bool", "complex64", "complex128")]


def decode_blob(data: memoryview, *, key: str, path: str) -> Any:
    """Blocks: a `torch.save` blob of a DCP item as its value (a CPU tensor, or a Python value
    of tensors, containers, scalars and numpy arrays); nothing else is unpickled.

    Raises:
        CorruptCheckpointError: the blob is not a loadable `torch.save` blob (names the item).
    """
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"item {key!r} in {path}: expected a torch.save blob of tensors and plain values, "
            f"found {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; the "
            "item is damaged or holds objects asynctron refuses to unpickle",
            path=path, key=key) from exc


def tensor_of(value: Any, record: ItemRecord, path: str) -> torch.Tensor:
    """`value` decoded for a tensor item, checked against the item's dtype and chunk shape."""
    assert record.dtype is not None and record.shape is not None
    expected = TORCH_DTYPES[record.dtype]
    if not isinstance(value, torch.Tensor) or value.dtype != expected or tuple(
            value.shape) != record.shape:
        found = (f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor)
                 else type(value).__name__)
        raise CorruptCheckpointError(
            f"item {record.key!r} in {path}: expected {expected} {list(record.shape)}, found "
            f"{found}; the item does not match the checkpoint's metadata",
            path=path, key=record.key, offset=record.offset)
    return value
