"""The manifest: the JSON description of a committed checkpoint, and its validation.

A manifest is data from disk, so loading treats it as hostile: every field is type- and
range-checked, file names must be bin file names inside the checkpoint, dtypes come from a
closed table, and nothing is ever unpickled.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asynctron.errors import CorruptCheckpointError
from asynctron.storage._checksum import ALGORITHMS, is_digest
from asynctron.storage._dtypes import NUMPY_DTYPES, TORCH_DTYPES
from asynctron.storage._plan import ItemKind, Structure

MANIFEST_NAME = "manifest.json"
FORMAT = "asynctron"
VERSION = 1
#: A manifest larger than this is refused before parsing.
MAX_MANIFEST_BYTES = 512 << 20
_BIN_FILE = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")
_STRUCTURE_TAGS = frozenset({"dict", "list", "tuple", "item", "value"})


@dataclass(frozen=True, slots=True)
class ItemRecord:
    """Where one item (a tensor chunk, ndarray or bytes) lives and how to check it.

    `shape` is the stored (local chunk) shape; `global_shape` and `chunk_offsets` place the chunk
    in the full tensor (equal to `shape` and zeros for an unsharded tensor). Bytes items have
    `dtype`, shapes and offsets set to None. `checksum` is the item's digest (see
    `Manifest.checksum` for the algorithm), or None in a checkpoint saved without checksums.

    `encoding` says how the stored bytes hold the value: `"raw"` (the tensor's bytes, as
    asynctron writes them) or `"torch_save"` (a `torch.save` blob, as in a stock DCP
    checkpoint, where kind `"object"` is a saved Python value). An asynctron manifest stores
    the field only for `torch_save` items (objects in a checkpoint saved in DCP's format).
    """

    key: str
    kind: ItemKind
    dtype: str | None
    shape: tuple[int, ...] | None
    global_shape: tuple[int, ...] | None
    chunk_offsets: tuple[int, ...] | None
    file: str
    offset: int
    nbytes: int
    checksum: str | None
    encoding: Literal["raw", "torch_save"] = "raw"


@dataclass(frozen=True, slots=True)
class Manifest:
    """A committed checkpoint: its structure, its items and its files (name -> size in bytes).

    `created_unix_s` is when the save was requested: the time the state is from. `checksum`
    names the per-item digest algorithm (`"xxh3_64"`), or is None when items carry none.
    """

    structure: Structure
    items: tuple[ItemRecord, ...]
    files: dict[str, int]
    created_unix_s: float
    checksum: str | None

    def to_json(self) -> bytes:
        """The manifest's JSON (see `encode_manifest`)."""
        return encode_manifest(structure=json.dumps(self.structure, separators=_COMPACT),
                               items=self.items, checksums=None, files=self.files,
                               created_unix_s=self.created_unix_s, checksum=self.checksum)

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    def by_key(self) -> dict[str, list[ItemRecord]]:
        """Items grouped by key (a sharded tensor has one record per chunk)."""
        return _group_by_key(self.items)


_COMPACT = (",", ":")
_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def encode_manifest(*, structure: str, items: Sequence[ItemRecord],
                    checksums: Sequence[str] | None, files: dict[str, int],
                    created_unix_s: float, checksum: str | None) -> bytes:
    """A manifest's JSON, from its structure's JSON text and its items (`checksums`, when
    given, are the items' digests in place of their records' own).

    Encoded item by item, each by a format string: one C encoder call over 100k items would
    hold the GIL (stalling every other thread, the event loop's too) for seconds.
    """
    head = json.dumps({"format": FORMAT, "version": VERSION, "created_unix_s": created_unix_s,
                       "checksum": checksum, "files": files}, separators=_COMPACT)
    if checksums is None:
        checksums = [item.checksum for item in items]
    encoded = ",".join(map(_item_json, items, checksums))
    return f'{head[:-1]},"items":[{encoded}],"structure":{structure}}}'.encode()


def _item_json(item: ItemRecord, checksum: str | None) -> str:
    dtype = "null" if item.dtype is None else f'"{item.dtype}"'
    digest = "null" if checksum is None else f'"{checksum}"'
    encoding = "" if item.encoding == "raw" else f',"encoding":"{item.encoding}"'
    return (f'{{"key":{_string(item.key)},"kind":"{item.kind}","dtype":{dtype},'
            f'"shape":{_ints(item.shape)},"global_shape":{_ints(item.global_shape)},'
            f'"chunk_offsets":{_ints(item.chunk_offsets)},"file":"{item.file}",'
            f'"offset":{item.offset},"nbytes":{item.nbytes},"checksum":{digest}{encoding}}}')


def _ints(values: tuple[int, ...] | None) -> str:
    return "null" if values is None else f"[{','.join(map(str, values))}]"


def parse_manifest(data: bytes, path: str) -> Manifest:
    """Parse and validate manifest bytes read from `path`.

    Raises:
        CorruptCheckpointError: anything malformed, naming the field at fault.
    """

    def fail(what: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"manifest {path}: {what}; the checkpoint is damaged "
                                      "or not an asynctron checkpoint", path=path, key=key)

    try:
        body = json.loads(data, object_pairs_hook=_object)
    except (ValueError, RecursionError) as exc:
        raise fail(f"expected JSON, found {type(exc).__name__}: {exc}") from exc
    if not isinstance(body, dict):
        raise fail(f"expected a JSON object, found {type(body).__name__}")
    if body.get("format") != FORMAT:
        raise fail(f"expected format {FORMAT!r}, found {body.get('format')!r}")
    if body.get("version") != VERSION:
        raise fail(f"expected version {VERSION}, found {body.get('version')!r} "
                   "(a newer asynctron may read it)")
    files = body.get("files")
    if not isinstance(files, dict):
        raise fail("field 'files': expected an object")
    for name, size in files.items():
        if not _BIN_FILE.fullmatch(name):
            raise fail(f"file name {name!r}: expected __<rank>_<bin>.distcp")
        if not is_count(size):
            raise fail(f"size of file {name!r}: expected a non-negative integer, found {size!r}")
    algorithm = body.get("checksum")
    if algorithm not in ALGORITHMS:
        raise fail(f"field 'checksum': expected one of {sorted(map(str, ALGORITHMS))}, found "
                   f"{algorithm!r}")
    raw_items = body.get("items")
    if not isinstance(raw_items, list):
        raise fail("field 'items': expected a list")
    items = tuple(_parse_item(raw, files, algorithm, fail) for raw in raw_items)
    check_chunks(items, fail)
    created = body.get("created_unix_s")
    if not isinstance(created, int | float):
        raise fail(f"field 'created_unix_s': expected a number, found {created!r}")
    structure = body.get("structure")
    _check_structure(structure, {item.key for item in items}, fail)
    return Manifest(structure=structure, items=items, files=files, created_unix_s=created,
                    checksum=algorithm)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, built by Python code: the parser then lets other threads (the event
    loop's) take the GIL between objects, where one C call over a manifest of 100k items held
    it for a second."""
    return dict(pairs)


def check_chunks(items: Sequence[ItemRecord],
                 fail: Callable[[str, str | None], CorruptCheckpointError]) -> None:
    """Check that each key's records agree (kind, dtype, global shape) and that its chunks
    tile the whole tensor: none overlaps another, and together they cover every element.

    Raises:
        the `fail(what, key)` error naming the key (and chunk) at fault.
    """
    for key, records in _group_by_key(items).items():
        first = records[0]
        for record in records[1:]:
            if (record.kind, record.dtype, record.global_shape) != (
                    first.kind, first.dtype, first.global_shape):
                raise fail(f"item {key!r}: expected every chunk with one kind, dtype and global "
                           f"shape, found {first.kind}/{first.dtype}/{first.global_shape} and "
                           f"{record.kind}/{record.dtype}/{record.global_shape}", key)
        if first.global_shape is None:
            if len(records) > 1:
                raise fail(f"item {key!r}: listed {len(records)} times", key)
            continue
        _check_tiling(key, records, first.global_shape, fail)


def _group_by_key(items: Sequence[ItemRecord]) -> dict[str, list[ItemRecord]]:
    grouped: dict[str, list[ItemRecord]] = {}
    for item in items:
        grouped.setdefault(item.key, []).append(item)
    return grouped


def _check_tiling(key: str, records: list[ItemRecord], global_shape: tuple[int, ...],
                  fail: Callable[[str, str | None], CorruptCheckpointError]) -> None:
    """No two chunks overlap (a sweep along dim 0 compares only chunks whose rows meet), and
    their volumes add up to the tensor's, so together they cover it."""
    boxes = sorted((r.chunk_offsets or (), r.shape or ()) for r in records)
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, shape in boxes:
        if 0 in shape:
            continue
        if offsets:
            active = [(o, s) for o, s in active if o[0] + s[0] > offsets[0]]
        for other_offsets, other_shape in active:
            if all(a < b + m and b < a + n for a, n, b, m in zip(
                    offsets, shape, other_offsets, other_shape, strict=True)):
                raise fail(f"item {key!r}: chunk at {list(offsets)} of shape {list(shape)} "
                           f"overlaps the chunk at {list(other_offsets)}", key)
        active.append((offsets, shape))
    covered = sum(math.prod(shape) for _, shape in boxes)
    if covered != math.prod(global_shape):
        raise fail(f"item {key!r}: expected chunks covering all {math.prod(global_shape)} "
                   f"elements of shape {list(global_shape)}, found {covered}", key)


def is_count(value: Any) -> bool:
    """Whether a parsed JSON value is a non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(is_count(v) for v in value):
        return tuple(value)
    return None


def _parse_item(raw: Any, files: dict[str, int], algorithm: str | None, fail: Any) -> ItemRecord:
    if not isinstance(raw, dict):
        raise fail(f"item: expected an object, found {type(raw).__name__}")
    key = raw.get("key")
    if not isinstance(key, str) or "\x00" in key:
        raise fail(f"item key {key!r}: expected a string without NUL")
    kind = raw.get("kind")
    file, offset, nbytes = raw.get("file"), raw.get("offset"), raw.get("nbytes")
    checksum = raw.get("checksum")
    encoding = raw.get("encoding", "raw")
    if kind not in ("tensor", "ndarray", "bytes", "object"):
        raise fail(f"item {key!r} kind {kind!r}: expected tensor, ndarray, bytes or object", key)
    if encoding != ("torch_save" if kind == "object" else "raw"):
        raise fail(f"item {key!r} encoding {encoding!r}: expected torch_save for objects, raw "
                   "otherwise", key)
    if file not in files:
        raise fail(f"item {key!r} file {file!r}: expected one of the manifest's files", key)
    if not (is_count(offset) and is_count(nbytes)) or offset + nbytes > files[file]:
        raise fail(f"item {key!r} bytes [{offset!r}, +{nbytes!r}): expected inside {file} "
                   f"({files[file]} bytes)", key)
    if not (is_digest(checksum) if algorithm is not None else checksum is None):
        expected = "16 lowercase hex digits" if algorithm is not None else "null"
        raise fail(f"item {key!r} checksum {checksum!r}: expected {expected} ({algorithm})", key)
    if kind in ("bytes", "object"):
        return ItemRecord(key, kind, None, None, None, None, file, offset, nbytes, checksum,
                          encoding)
    dtype = raw.get("dtype")
    table = TORCH_DTYPES if kind == "tensor" else NUMPY_DTYPES
    if dtype not in table:
        raise fail(f"item {key!r} dtype {dtype!r}: expected one of {sorted(table)}", key)
    shape = _parse_shape(raw.get("shape"))
    global_shape = _parse_shape(raw.get("global_shape"))
    chunk_offsets = _parse_shape(raw.get("chunk_offsets"))
    if shape is None or global_shape is None or chunk_offsets is None or not (
            len(shape) == len(global_shape) == len(chunk_offsets)):
        raise fail(f"item {key!r}: expected shape, global_shape and chunk_offsets as lists of "
                   "non-negative integers of one length", key)
    if any(o + s > g for o, s, g in zip(chunk_offsets, shape, global_shape, strict=True)):
        raise fail(f"item {key!r} chunk at {list(chunk_offsets)} of shape {list(shape)}: "
                   f"expected inside global shape {list(global_shape)}", key)
    expected = math.prod(shape) * table[dtype].itemsize
    if expected != nbytes:
        raise fail(f"item {key!r}: expected {expected} bytes for {dtype} {list(shape)}, "
                   f"found nbytes {nbytes}", key)
    return ItemRecord(key, kind, dtype, shape, global_shape, chunk_offsets, file, offset,
                      nbytes, checksum)


def _check_structure(structure: Any, keys: set[str], fail: Any) -> None:
    """Walk the structure iteratively (hostile nesting cannot overflow the stack)."""
    referenced: set[str] = set()
    stack = [structure]
    while stack:
        node = stack.pop()
        if not (isinstance(node, dict) and len(node) == 1):
            raise fail(f"structure node {str(node)[:80]!r}: expected an object with one tag")
        (tag, body), = node.items()
        if tag not in _STRUCTURE_TAGS:
            raise fail(f"structure tag {tag!r}: expected one of {sorted(_STRUCTURE_TAGS)}")
        if tag == "item":
            if body not in keys:
                raise fail(f"structure references item {body!r}, which the manifest lacks")
            referenced.add(body)
        elif tag == "dict":
            if not isinstance(body, list):
                raise fail("structure dict: expected a list of [key, node] pairs")
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(
                        pair[0], str | int) and not isinstance(pair[0], bool)):
                    raise fail(f"structure dict entry {str(pair)[:80]!r}: expected [key, node]")
                stack.append(pair[1])
        elif tag in ("list", "tuple"):
            if not isinstance(body, list):
                raise fail(f"structure {tag}: expected a list")
            stack.extend(body)
        elif tag == "value" and isinstance(body, dict | list):
            raise fail("structure value: expected a JSON scalar")
    if referenced != keys:
        missing = sorted(keys - referenced)[:3]
        raise fail(f"items {missing} are not referenced by the structure")
