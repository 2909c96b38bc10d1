"""torch.distributed.checkpoint's own on-disk format: reading stock DCP checkpoints without
unpickling anything but DCP's metadata types, and what writing it (`format="dcp"`) needs.

A DCP checkpoint is a directory holding a pickled `.metadata` (a `Metadata`: per key, its
tensor chunks or a bytes entry; per stored item, its file, offset and length; the mapping of
flattened keys back to nested paths) and `__<rank>_<n>.distcp` files whose tensor items are
`torch.save` blobs and whose bytes items are `torch.save`d Python values.

Reading it never runs foreign code: `.metadata` goes through `MetadataUnpickler`, which admits
only DCP's metadata classes, torch dtypes and `torch.Size` (any other global is a
`CorruptCheckpointError` naming it), and item blobs go through `torch.load(weights_only=True)`
(tensors, containers, numpy arrays and scalars of numeric dtypes, and what the user admits
with `torch.serialization.add_safe_globals`; anything else is a `RefusedObjectError` naming the
item and the refused globals; `check_object_blob` refuses such a value at save time). The
result is an ordinary `Manifest` whose items say `encoding="torch_save"`, so the engine's loader
reads both formats.

Writing: a `torch.save` blob of a contiguous tensor is a constant prefix, the raw bytes and a
constant suffix, given the dtype and shape (`torch_save_frame`), so asynctron's pipeline writes
DCP's files at its own speed: frames around raw bodies, plus `metadata_bytes`.
"""

from __future__ import annotations

import collections
import functools
import io
import itertools
import math
import pathlib
import pickle
import re
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from asynctron.errors import CorruptCheckpointError, RefusedObjectError
from asynctron.storage import _pickle_costs
from asynctron.storage.format._dtypes import TORCH_DTYPE_NAMES, TORCH_DTYPES
from asynctron.storage.format._manifest import (
    MAX_DIMS,
    ItemRecord,
    Manifest,
    brief,
    check_chunks,
    check_fits,
    is_count,
    paused_gc,
)
from asynctron.storage.format._plan import Structure, item_paths, value_paths

METADATA_NAME = ".metadata"
#: A `.metadata` larger than this is refused before unpickling. A stock DCP checkpoint takes
#: about 290 bytes an item (whole tensors, 40-character keys: 289 MB for 1M items; about 135 a
#: chunk of a sharded tensor), so this admits about 1.3M items.
MAX_METADATA_BYTES = 384 << 20
#: What unpickling a `.metadata` may cost by `_pickle_costs.check`'s count, per byte of it,
#: above a floor. Real DCP metadata counts 22-32 bytes and 0.8-1.3 elements a byte (the most
#: for tensors of many dims under short keys; the objects themselves take about 12 bytes a
#: byte): so up to 1 GiB, or half again what the costliest real checkpoint of that size counts.
UNPICKLE_BYTES_PER_BYTE = 48
UNPICKLE_WORK_PER_BYTE = 4
MIN_UNPICKLE_BYTES = 1 << 30
MIN_UNPICKLE_WORK = 1 << 26
#: A path in `StorageMeta`: as long as Linux lets a path be.
MAX_PATH_CHARS = 4096
_DATA_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")

_DCP_METADATA_TYPES = frozenset({
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "MetadataIndex", "StorageMeta")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
})
_LAYOUTS = {str(value): value for value in vars(torch).values()
            if isinstance(value, torch.layout)}


def _layout(name: object) -> torch.layout:
    """`torch.serialization._get_layout` for names only (a hostile key's KeyError would
    carry its repr)."""
    if isinstance(name, str) and name in _LAYOUTS:
        return _LAYOUTS[name]
    raise pickle.UnpicklingError(f"layout {brief(name)}: expected the name of a torch layout")


def _memory_format(value: object) -> _MEM_FORMAT_ENCODING:
    """`_MEM_FORMAT_ENCODING(value)` for ints only (the enum's ValueError carries the repr of
    what it is given)."""
    if type(value) is not int:
        raise pickle.UnpicklingError(f"memory format {brief(value)}: expected an int")
    return _MEM_FORMAT_ENCODING(value)


class _TensorProperties(TensorProperties):
    """`TensorProperties` whose state is checked before its own `__setstate__`, which formats a
    bad memory-format encoding (of any size) into its error message."""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5
                and isinstance(state[3], _MEM_FORMAT_ENCODING)):
            raise pickle.UnpicklingError(f"TensorProperties state {brief(state)}: expected "
                                         "(dtype, layout, requires_grad, memory format, "
                                         "pin_memory)")
        super().__setstate__(state)


def _path_of(cls: type[pathlib.PurePath]) -> Callable[..., pathlib.PurePath]:
    """`cls(*parts)` for a few str parts: joining one long part, memoised, many times over
    would allocate far more than the pickle holds."""
    def path(*parts: object) -> pathlib.PurePath:
        if not all(isinstance(part, str) for part in parts) or (
                sum(len(part) + 1 for part in parts) > MAX_PATH_CHARS):
            raise pickle.UnpicklingError(f"{cls.__name__} of {brief(parts)}: expected str parts "
                                         f"of at most {MAX_PATH_CHARS} characters in all")
        return cls(*parts)
    return path


def _ordered_dict(*args: object) -> collections.OrderedDict:
    """`OrderedDict()`, as its pickle makes it (items follow as SETITEMS, which
    `_pickle_costs` counts); given items, it would hash whatever they are."""
    if args:
        raise pickle.UnpicklingError("OrderedDict with arguments: expected its items as "
                                     "SETITEMS, as pickle writes them")
    return collections.OrderedDict()


_GUARDED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.serialization", "_get_layout"): _layout,
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _memory_format,
    ("torch.distributed.checkpoint.metadata", "TensorProperties"): _TensorProperties,
    ("pathlib", "PosixPath"): _path_of(pathlib.PosixPath),
    ("pathlib", "PurePosixPath"): _path_of(pathlib.PurePosixPath),
    ("collections", "OrderedDict"): _ordered_dict,
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata`, admitting only DCP's metadata types and torch dtypes
    (some of them through guards that check their arguments first), once `_pickle_costs` has
    found its costs within `UNPICKLE_BYTES_PER_BYTE` and `UNPICKLE_WORK_PER_BYTE` of its
    size."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self._data = data
        self._path = path

    def load(self) -> Any:
        try:
            check_pickle_costs(self._data)
        except ValueError as exc:
            raise CorruptCheckpointError(f"metadata {self._path}: {exc}; refusing to unpickle it",
                                         path=self._path) from None
        return super().load()

    def find_class(self, module: str, name: str) -> Any:
        guarded = _GUARDED_GLOBALS.get((module, name))
        if guarded is not None:
            return guarded
        if (module, name) in _DCP_METADATA_TYPES or (module == "torch" and name in TORCH_DTYPES):
            return super().find_class(module, name)
        raise CorruptCheckpointError(
            f"metadata {self._path}: expected only DCP metadata types, found global "
            f"{module[:80]}.{name[:80]}; refusing to unpickle it", path=self._path)


def check_pickle_costs(data: bytes | memoryview) -> None:
    """Raises ValueError (naming the byte) unless unpickling `data` costs at most
    `UNPICKLE_BYTES_PER_BYTE` and `UNPICKLE_WORK_PER_BYTE` of its size, above the floors."""
    size = len(data)
    _pickle_costs.check(data, max(MIN_UNPICKLE_BYTES, UNPICKLE_BYTES_PER_BYTE * size),
                        max(MIN_UNPICKLE_WORK, UNPICKLE_WORK_PER_BYTE * size))


def parse_dcp_manifest(raw: bytes, checkpoint: str, created_unix_s: float,
                       sizes: Callable[[str], int | None]) -> Manifest:
    """The manifest of the stock DCP checkpoint `checkpoint` (a path or URL) from its
    `.metadata` bytes `raw`, whose data files are `sizes(name)` bytes (None: missing).
    Bounds and errors: see `asynctron.storage.backends.local._reader.read_dcp_manifest`."""
    path = f"{checkpoint.rstrip('/')}/{METADATA_NAME}"

    def fail(what: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"metadata {path}: {what}; the checkpoint is damaged or "
                                      "not a torch.distributed.checkpoint checkpoint",
                                      path=path, key=key)

    with paused_gc():
        try:
            metadata = MetadataUnpickler(raw, path).load()
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            raise fail(f"expected a pickled Metadata, found {_exception_text(exc)}") from exc
        manifest = _manifest_of(metadata, checkpoint, created_unix_s,
                                len(raw) // METADATA_BYTES_PER_CHUNK, fail, sizes)
        del metadata  # freed now, by reference counts: the collector never walks it
    return manifest


def _manifest_of(metadata: Any, checkpoint: str, created_unix_s: float, max_chunks: int,
                 fail: Callable[..., CorruptCheckpointError],
                 sizes: Callable[[str], int | None]) -> Manifest:
    """The manifest of an unpickled `.metadata`. Its objects were made by NEWOBJ and BUILD,
    which may have left any attribute out: each is read with a default."""
    if not isinstance(metadata, Metadata):
        raise fail(f"expected a pickled Metadata, found {type(metadata).__name__}")
    state_dict_metadata = getattr(metadata, "state_dict_metadata", None)
    storage_data = getattr(metadata, "storage_data", None)
    for field, value in (("state_dict_metadata", state_dict_metadata),
                         ("storage_data", storage_data)):
        if not isinstance(value, Mapping):
            raise fail(f"field {field!r}: expected a mapping, found {brief(value)}")
    items, files = _records(state_dict_metadata, storage_data, checkpoint, sizes,
                            _ChunkTables(max_chunks, fail), fail)
    check_chunks(items, fail)
    stored = {item.key for item in items}
    structure = dcp_structure(getattr(metadata, "planner_data", None),
                           [key for key in state_dict_metadata if key in stored])
    return Manifest(structure=structure, items=tuple(items), files=files,
                    created_unix_s=created_unix_s, checksum=None)


def _exception_text(exc: Exception) -> str:
    """The type and (bounded) message of an exception raised while unpickling; a message is
    shown only when it is a string, since str() of another argument is its repr."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        return f"{type(exc).__name__}: {brief(exc.args[0])}"
    return type(exc).__name__


def _records(state_dict_metadata: Mapping[Any, Any], storage_data: Mapping[Any, Any],
             checkpoint: str, file_sizes: Callable[[str], int | None], tables: _ChunkTables,
             fail: Callable[..., CorruptCheckpointError]
             ) -> tuple[list[ItemRecord], dict[str, int]]:
    """One record per stored item, each checked against its data file; the files' sizes."""
    sizes: dict[str, int] = {}
    items = []
    for index, info in storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise fail(f"storage entry {brief(index)}: expected MetadataIndex -> _StorageInfo")
        key = getattr(index, "fqn", None)
        if not isinstance(key, str) or "\x00" in key:
            raise fail(f"item key {brief(key)}: expected a string without NUL")
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _DATA_FILE.fullmatch(name) or name == METADATA_NAME:
            raise fail(f"item {key!r} file {brief(name)}: expected a file name inside the "
                       "checkpoint", key)
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:
            raise fail(f"item {key!r}: expected no stream transforms, found {brief(transforms)}",
                       key)
        if name not in sizes:
            size = file_sizes(name)
            if size is None:
                file_path = f"{checkpoint.rstrip('/')}/{name}"
                raise CorruptCheckpointError(
                    f"file {file_path}: expected a data file, found none; the checkpoint lost "
                    "a file", path=file_path, key=key)
            sizes[name] = size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (is_count(offset) and is_count(length)) or offset + length > sizes[name]:
            raise fail(f"item {key!r} bytes [{brief(offset)}, +{brief(length)}): expected "
                       f"inside {name} ({sizes[name]} bytes)", key)
        entry = state_dict_metadata.get(key)
        if isinstance(entry, BytesStorageMetadata):
            items.append(ItemRecord(key=key, kind="object", file=name, offset=offset,
                                    nbytes=length, checksum=None, encoding="torch_save"))
        else:
            items.append(tables.record(key, entry, getattr(index, "offset", None), name, offset,
                                       length))
    return items, sizes


#: A real chunk costs about 135 bytes of `.metadata` (itself and its storage entry); chunk
#: lists holding more than one chunk per this many bytes of the file are shared between keys.
METADATA_BYTES_PER_CHUNK = 32


class _ChunkTables:
    """Each tensor key's chunks by offsets, built once per key on first use.

    All chunk lists together may hold at most `budget` chunks: a list shared between keys is
    refused before it is walked (finding each item's chunk in it would cost keys times chunks),
    and a chunk listed twice in a key's list when it is walked.
    """

    def __init__(self, budget: int, fail: Callable[..., CorruptCheckpointError]) -> None:
        self._budget = budget
        self._num_chunks = 0
        self._fail = fail
        self._tables: dict[str, tuple[str, tuple[int, ...], dict[tuple[int, ...],
                                                                  tuple[int, ...]]]] = {}

    def record(self, key: str, entry: Any, at: Any, file: str, offset: int,
               length: int) -> ItemRecord:
        """The record of `key`'s chunk at offsets `at`, stored as a blob of `length` bytes."""
        fail = self._fail
        if key not in self._tables:
            self._tables[key] = self._table(key, entry)
        dtype, size, chunks = self._tables[key]
        offsets = _dims(() if at is None else at)
        shape = chunks.get(offsets) if offsets is not None else None
        if offsets is None or shape is None:
            raise fail(f"item {key!r} at chunk {brief(at)}: expected one of the key's chunks",
                       key)
        nbytes = math.prod(shape) * TORCH_DTYPES[dtype].itemsize
        if length < nbytes:
            raise fail(f"item {key!r} chunk at {list(offsets)} in {file}: expected a torch.save "
                       f"blob of at least {nbytes} bytes for {dtype} {list(shape)}, found "
                       f"{length}", key)
        return ItemRecord(key=key, kind="tensor", file=file, offset=offset, nbytes=length,
                          checksum=None, dtype=dtype, shape=shape, global_shape=size,
                          chunk_offsets=offsets, encoding="torch_save")

    def _table(self, key: str, entry: Any) -> tuple[str, tuple[int, ...],
                                                    dict[tuple[int, ...], tuple[int, ...]]]:
        fail = self._fail
        if not isinstance(entry, TensorStorageMetadata):
            raise fail(f"item {key!r}: expected tensor or bytes metadata, found "
                       f"{type(entry).__name__}", key)
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype) or dtype not in TORCH_DTYPE_NAMES:
            raise fail(f"item {key!r} dtype {brief(dtype)}: expected one of "
                       f"{sorted(TORCH_DTYPES)}", key)
        claimed_size = getattr(entry, "size", None)
        size = _dims(claimed_size)
        if size is None:
            raise fail(f"item {key!r} size: expected a torch.Size of at most {MAX_DIMS} dims in "
                       f"[0, 2**63), found {_shape_text(claimed_size)}", key)
        check_fits(key, size, dtype.itemsize, fail)
        chunks = getattr(entry, "chunks", None)
        if not isinstance(chunks, list):
            raise fail(f"item {key!r} chunks {brief(chunks)}: expected a list", key)
        self._num_chunks += len(chunks)
        if self._num_chunks > self._budget:
            raise fail(f"field 'state_dict_metadata': expected at most {self._budget} chunks "
                       f"in all (one per {METADATA_BYTES_PER_CHUNK} bytes of the file), found "
                       f"{self._num_chunks} by key {key!r}; chunks are listed more than once "
                       "(lists shared between keys, or chunks repeated)", key)
        table: dict[tuple[int, ...], tuple[int, ...]] = {}
        for chunk in chunks:
            claimed = (getattr(chunk, "offsets", None), getattr(chunk, "sizes", None))
            offsets, shape = map(_dims, claimed) if isinstance(
                chunk, ChunkStorageMetadata) else (None, None)
            if offsets is None or shape is None or not len(offsets) == len(shape) == len(size):
                found = (f"offsets {_shape_text(claimed[0])}, sizes {_shape_text(claimed[1])}"
                         if isinstance(chunk, ChunkStorageMetadata) else brief(chunk))
                raise fail(f"item {key!r} chunk: expected offsets and sizes of {len(size)} dims "
                           f"in [0, 2**63), found {found}", key)
            if any(o + s > g for o, s, g in zip(offsets, shape, size, strict=True)):
                raise fail(f"item {key!r} chunk at {list(offsets)} of shape {list(shape)}: "
                           f"expected inside global shape {list(size)}", key)
            if table.setdefault(offsets, shape) is not shape:
                raise fail(f"item {key!r}: chunk at {list(offsets)} listed twice", key)
        return TORCH_DTYPE_NAMES[dtype], size, table


def _dims(value: Any) -> tuple[int, ...] | None:
    """`value` as a shape or offsets: a tuple (`torch.Size`) of at most `MAX_DIMS` ints in
    [0, 2**63), else None."""
    if isinstance(value, tuple) and len(value) <= MAX_DIMS and all(map(is_count, value)):
        return tuple(value)
    return None


def _shape_text(value: Any) -> str:
    """A claimed shape for an error message: its dims (each `brief`), or its dim count."""
    if not isinstance(value, tuple):
        return brief(value)
    if len(value) > MAX_DIMS:
        return f"{len(value)} dims"
    return f"[{', '.join(map(brief, value))}]"


def dcp_structure(planner_data: Any, keys: Sequence[str]) -> Structure:
    """The nesting DCP flattened (its planner data maps each key to its path), as a structure;
    a flat dict of keys where the mapping is missing or inconsistent (a path longer than its
    key, or a key's place taken by another)."""
    flat: Structure = {"dict": [[key, {"item": key}] for key in dict.fromkeys(keys)]}
    if not isinstance(planner_data, Mapping):
        return flat
    root: dict[str | int, Any] = {}
    for key in dict.fromkeys(keys):
        path = planner_data.get(key)
        if not (isinstance(path, tuple) and 0 < len(path) <= len(key) + 1 and all(
                isinstance(p, str | int) and not isinstance(p, bool) for p in path)):
            return flat
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                return flat
        if path[-1] in node:
            return flat
        node[path[-1]] = key
    return _encode(root)


def _encode(root: dict[str | int, Any]) -> Structure:
    """Nested dicts of keys as a structure (a dict with keys 0..n-1 is a list); iterative, so
    nesting as deep as a key is long cannot overflow the stack."""
    encoded: Structure = {}
    stack = [(root, encoded)]
    while stack:
        node, target = stack.pop()
        children = [{} for _ in node]
        if node and all(isinstance(k, int) for k in node) and sorted(node) == list(
                range(len(node))):
            target["list"] = children
            values = [node[i] for i in range(len(node))]
        else:
            target["dict"] = [[k, child] for k, child in zip(node, children, strict=True)]
            values = list(node.values())
        for value, child in zip(values, children, strict=True):
            if isinstance(value, str):
                child["item"] = value
            else:
                stack.append((value, child))
    return encoded


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


def metadata_of(manifest: Manifest) -> Metadata:
    """DCP's metadata for a checkpoint in asynctron's format (no `.metadata` of its own), so
    `dcp.load` plans against it: its tensors' chunks, and a bytes entry for every other value
    (bytes and ndarray items, and the structure's JSON values, which a reader hands DCP's
    planner as `torch.save`d values: `saved_value`)."""
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for record in manifest.items:
        if record.kind != "tensor":
            state_dict_metadata[record.key] = BytesStorageMetadata()
            continue
        assert record.dtype is not None and record.global_shape is not None
        assert record.shape is not None and record.chunk_offsets is not None
        entry = state_dict_metadata.setdefault(record.key, TensorStorageMetadata(
            properties=TensorProperties(dtype=TORCH_DTYPES[record.dtype]),
            size=torch.Size(record.global_shape), chunks=[]))
        assert isinstance(entry, TensorStorageMetadata)
        entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(record.chunk_offsets),
                                                 sizes=torch.Size(record.shape)))
    for key in value_paths(manifest.structure, whole_lists=True):
        state_dict_metadata.setdefault(key, BytesStorageMetadata())
    return Metadata(state_dict_metadata=state_dict_metadata,
                    planner_data=item_paths(manifest.structure), storage_data={},
                    version=CURRENT_DCP_VERSION)


def saved_value(value: Any) -> bytes:
    """Blocks: `value` (a JSON value, bytes, an ndarray) as `torch.save` writes it: what DCP's
    planner loads for a bytes entry."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


#: What `decode_blob` admits beyond torch's own `weights_only` allowlist: numpy arrays and
#: scalars of numeric and bool dtypes (`np.random.get_state()`, `np.float64(...)`), as torch
#: documents for `weights_only` loads. No object, string, void or datetime dtype: nothing that
#: can name another global is admitted.
_NUMPY_DTYPE_NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                      "uint64", "float16", "float32", "float64", "longdouble", "complex64",
                      "complex128", "clongdouble")
_NUMPY_GLOBALS = [np.ndarray, np.dtype, np._core.multiarray._reconstruct,
                  np._core.multiarray.scalar,
                  *dict.fromkeys(type(np.dtype(name)) for name in _NUMPY_DTYPE_NAMES)]


def decode_blob(data: memoryview, *, key: str, path: str) -> Any:
    """Blocks: a `torch.save` blob of a DCP item as its value (a CPU tensor, or a Python value
    of tensors, containers, scalars and numpy arrays and scalars, and whatever
    `torch.serialization.add_safe_globals` admits); nothing else is unpickled, and its pickle
    only once `check_pickle_costs` passes it.

    Raises:
        RefusedObjectError: the blob holds globals asynctron does not unpickle (names the item
            and them, and `torch.serialization.add_safe_globals`).
        CorruptCheckpointError: the blob is not a loadable `torch.save` blob (names the item).
    """
    try:
        check_pickle_costs(_pickle_of(data))
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        refused = _refusal(exc, data)
        if refused is not None:
            raise RefusedObjectError(
                refused, f"item {key!r} in {path}: holds {refused}, which asynctron does "
                "not unpickle (only tensors, plain values, and numpy arrays and scalars of "
                "numeric dtypes; unpickling other globals could run code); the item is not "
                "damaged. If you trust the checkpoint, allow them before loading: "
                "torch.serialization.add_safe_globals([...]) with those classes or functions",
                path=path, key=key) from exc
        raise CorruptCheckpointError(
            f"item {key!r} in {path}: expected a torch.save blob of tensors and plain values, "
            f"found {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; the "
            "item is damaged", path=path, key=key) from exc


def _refusal(exc: Exception, blob: bytes | memoryview) -> str | None:
    """What in `blob` torch's `weights_only` unpickler refused (the globals it names, or its
    reason), or None when `exc` is not such a refusal (the blob is damaged)."""
    if not isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" not in str(exc):
        return None
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob))
    except Exception:
        names = []
    if names:
        return ", ".join(names)
    reason = str(exc).split("WeightsUnpickler error:", 1)[-1]
    built = re.search(r"but got <class '([\w.]+)'>", reason)
    if built:
        return built.group(1)
    lines = reason.strip().splitlines()
    return f"objects ({lines[0][:200]})" if lines else "objects"


def check_object_blob(blob: bytes | memoryview, *, key: str) -> None:
    """Blocks: refuse, at save time, a pickled value (a `torch.save` blob) that `decode_blob`
    would refuse when loading it, so that no unreadable checkpoint is written. Decodes it
    (pickled values are the small, non-tensor part of a state dict).

    Raises:
        TypeError: the value holds what asynctron's reader does not unpickle (names the key
            and it, and `torch.serialization.add_safe_globals`).
    """
    try:
        decode_blob(memoryview(blob), key=key, path="<save>")
    except RefusedObjectError as error:
        raise TypeError(
            f"value at key {key!r}: holds {error.refused}, which asynctron's reader does not "
            "unpickle (only tensors, plain values, and numpy arrays and scalars of numeric "
            "dtypes); convert it before saving (e.g. to a tensor, str or dict), or allow it on "
            "every process that saves or loads: torch.serialization.add_safe_globals([...])"
        ) from None
    except CorruptCheckpointError as error:
        raise TypeError(f"value at key {key!r}: asynctron's reader would refuse it: "
                        f"{str(error).split(': ', 1)[-1]}") from None


def _pickle_of(blob: memoryview) -> bytes:
    """The pickle in a `torch.save` blob (a zip archive holding `<name>/data.pkl`), read by
    the reader `torch.load` uses (which skips CRC-32s, as `torch_save_frame` leaves them out)."""
    return torch._C.PyTorchFileReader(io.BytesIO(blob)).get_record("data.pkl")


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
