"""The manifest: the JSON description of a committed checkpoint, and its validation.

A manifest is data from disk, so loading treats it as hostile: a field the format lacks is
refused before its value is parsed, every field is type- and range-checked, file names must be
bin file names inside the checkpoint, dtypes come from a closed table, and nothing is ever
unpickled.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from asynctron.errors import CorruptCheckpointError
from asynctron.storage.format._checksum import ALGORITHMS, is_digest
from asynctron.storage.format._dtypes import NUMPY_DTYPES, TORCH_DTYPES
from asynctron.storage.format._plan import ItemKind, Structure

MANIFEST_NAME = "manifest.json"
FORMAT = "asynctron"
VERSION = 1
#: A manifest larger than this is refused before parsing. A real one takes about 290 bytes an
#: item (40-character keys: 292 MB for 1M items), so this admits about 1.3M items; parsing
#: costs at most about 25 bytes of memory a byte, whatever the content (a real one: 4).
MAX_MANIFEST_BYTES = 384 << 20
#: At most this many dims per tensor (a DCP `.metadata` could claim millions).
MAX_DIMS = 64
MAX_INT64 = (1 << 63) - 1
_BIN_FILE = re.compile(r"__\d{1,9}_\d{1,9}\.distcp")
_STRUCTURE_TAGS = frozenset({"dict", "list", "tuple", "item", "value"})


@dataclass(frozen=True, kw_only=True, slots=True)
class ItemRecord:
    """Where one item (a tensor chunk, ndarray or bytes) lives and how to check it; built with
    keywords.

    `shape` is the stored (local chunk) shape; `global_shape` and `chunk_offsets` place the chunk
    in the full tensor (equal to `shape` and zeros for an unsharded tensor). Bytes and object
    items leave `dtype`, shapes and offsets None. `checksum` is the item's digest (see
    `Manifest.checksum` for the algorithm), or None in a checkpoint saved without checksums.

    `encoding` says how the stored bytes hold the value: `"raw"` (the tensor's bytes, as
    asynctron writes them) or `"torch_save"` (a `torch.save` blob, as in a stock DCP
    checkpoint, where kind `"object"` is a saved Python value). An asynctron manifest stores
    the field only for `torch_save` items (objects in a checkpoint saved in DCP's format).
    """

    key: str
    kind: ItemKind
    file: str
    offset: int
    nbytes: int
    checksum: str | None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    global_shape: tuple[int, ...] | None = None
    chunk_offsets: tuple[int, ...] | None = None
    encoding: Literal["raw", "torch_save"] = "raw"


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardInfo:
    """What a shard's manifest says of itself: it holds one rank's part of a checkpoint that
    `world_size` ranks saved (a tier's shard: `asynctron.engine.tiers`).

    A shard's items are the ones its rank wrote, so they need not cover a tensor (the other
    ranks' shards hold the rest) and its structure (the rank's whole state) may name keys that
    only other shards hold. `store_files` are the files a drain copies to the store.
    """

    rank: int
    world_size: int
    store_files: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """A committed checkpoint: its structure, its items and its files (name -> size in bytes).

    `created_unix_s` is when the save was requested: the time the state is from. `checksum`
    names the per-item digest algorithm (`"xxh3_64"`), or is None when items carry none.
    `shard` is None for a checkpoint (its items cover every tensor its structure names), or
    says whose part of one a shard holds.
    """

    structure: Structure
    items: tuple[ItemRecord, ...]
    files: dict[str, int]
    created_unix_s: float
    checksum: str | None
    shard: ShardInfo | None = None

    def to_json(self) -> bytes:
        """The manifest's JSON (see `encode_manifest`)."""
        return encode_manifest(structure=json.dumps(self.structure, separators=_COMPACT),
                               items=self.items, checksums=None, files=self.files,
                               created_unix_s=self.created_unix_s, checksum=self.checksum,
                               shard=self.shard)

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
                    created_unix_s: float, checksum: str | None,
                    shard: ShardInfo | None = None) -> bytes:
    """A manifest's JSON, from its structure's JSON text and its items (`checksums`, when
    given, are the items' digests in place of their records' own); a shard's with `shard`.

    Encoded item by item, each by a format string: one C encoder call over 100k items would
    hold the GIL (stalling every other thread, the event loop's too) for seconds.
    """
    fields: dict[str, Any] = {"format": FORMAT, "version": VERSION,
                              "created_unix_s": created_unix_s, "checksum": checksum,
                              "files": files}
    if shard is not None:
        fields["shard"] = {"rank": shard.rank, "world_size": shard.world_size,
                           "store_files": list(shard.store_files)}
    head = json.dumps(fields, separators=_COMPACT)
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

    Bounded: time and memory grow linearly with `len(data)`, whatever it holds. What no
    manifest holds is refused before it is built (`_Reader`): a field the format lacks, a list
    or object where a scalar belongs, an element of `items` that is not one flat object. Junk
    in the structure costs at most what a real structure's densest content costs a byte (empty
    containers: up to 25 bytes of memory a byte, against 4 for items), and an object of it
    that is not one node stops the parse where it stands. The parser lets other threads take
    the GIL between JSON objects (its hooks are Python code), and runs with the garbage
    collector paused (`paused_gc`).

    Raises:
        CorruptCheckpointError: anything malformed, naming the field at fault.
    """

    def fail(what: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"manifest {path}: {what}; the checkpoint is damaged "
                                      "or not an asynctron checkpoint", path=path, key=key)

    if not data.isascii():
        at = _NON_ASCII.search(data)
        assert at is not None
        raise fail(f"byte {at.start()}: expected ASCII JSON (asynctron escapes every other "
                   f"character), found {data[at.start()]:#04x}")
    with paused_gc():
        try:
            body = _Reader(data.decode("ascii"), fail).read()
        except (ValueError, RecursionError) as exc:
            raise fail(f"expected JSON, found {type(exc).__name__}: {brief(str(exc))}") from exc
        return _parse_body(body, fail)


_NON_ASCII = re.compile(rb"[\x80-\xff]")
_LAST_UNIX_S = 253_402_300_799  # 9999-12-31T23:59:59Z, the last time `datetime` holds


def _parse_body(body: dict[str, Any], fail: Callable[..., CorruptCheckpointError]) -> Manifest:
    if body.get("format") != FORMAT:
        raise fail(f"expected format {FORMAT!r}, found {brief(body.get('format'))}")
    if body.get("version") != VERSION:
        raise fail(f"expected version {VERSION}, found {brief(body.get('version'))} "
                   "(a newer asynctron may read it)")
    files = body.get("files")
    if files is None:
        raise fail("field 'files': expected an object")
    for name, size in files.items():  # bin file names (`_Reader._files`)
        if not is_count(size):
            raise fail(f"size of file {name!r}: expected a non-negative integer below 2**63, "
                       f"found {brief(size)}")
    algorithm = body.get("checksum")
    if not (algorithm is None or isinstance(algorithm, str)) or algorithm not in ALGORITHMS:
        raise fail(f"field 'checksum': expected one of {sorted(map(str, ALGORITHMS))}, found "
                   f"{brief(algorithm)}")
    items = body.get("items")
    if items is None:
        raise fail("field 'items': expected a list")
    for item in items:
        _check_item_place(item, files, algorithm, fail)
    shard = _shard_info(body.get("shard"), files, fail)
    check_chunks(items, fail, whole=shard is None)
    created = body.get("created_unix_s")
    if isinstance(created, bool) or not isinstance(created, int | float) or not (
            0 <= created <= _LAST_UNIX_S):
        raise fail(f"field 'created_unix_s': expected seconds since 1970 up to the year 9999, "
                   f"found {brief(created)}")
    structure = body.get("structure")
    _check_structure(structure, {item.key for item in items}, fail, whole=shard is None)
    return Manifest(structure=structure, items=tuple(items), files=files,
                    created_unix_s=created, checksum=algorithm, shard=shard)


def _shard_info(raw: Any, files: dict[str, int],
                fail: Callable[..., CorruptCheckpointError]) -> ShardInfo | None:
    """The `shard` field, checked (`_Reader._shard` refused any other member or shape)."""
    if raw is None:
        return None
    rank, world_size = raw.get("rank"), raw.get("world_size")
    if not (is_count(rank) and is_count(world_size) and rank < world_size):
        raise fail(f"field 'shard': expected 0 <= rank < world_size, found rank {brief(rank)} "
                   f"of world_size {brief(world_size)}")
    store_files = tuple(raw.get("store_files", ()))
    for name in store_files:
        if name not in files:
            raise fail(f"field 'shard': store file {name!r}: expected one of the manifest's "
                       "files")
    if len(set(store_files)) != len(store_files):
        raise fail("field 'shard': expected each store file once, found one listed twice")
    return ShardInfo(rank=rank, world_size=world_size, store_files=store_files)


#: A manifest's fields, and an item's (`encoding` only for torch_save items).
_FIELDS = ("format", "version", "created_unix_s", "checksum", "files", "items", "structure",
           "shard")
_SHARD_FIELDS = ("rank", "world_size", "store_files")
_ITEM_FIELDS = frozenset({"key", "kind", "dtype", "shape", "global_shape", "chunk_offsets",
                          "file", "offset", "nbytes", "checksum", "encoding"})
#: An item is parsed in a slice of the text of at most this many characters, or alone.
_CHUNK_CHARS = 1 << 20
_WS = r"[ \t\n\r]*+"
_SPACE = re.compile(_WS)
_NEXT_ITEM = re.compile(rf"{_WS}(?:(,){_WS}|\])")
_STRING = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_SCALAR = r'[^"{}\[\],: \t\n\r]++'  # a number, true, false or null: the parser checks which
_ITEM_FIELD = (rf"{_STRING}{_WS}:{_WS}(?:{_STRING}|{_SCALAR}|\[{_WS}(?:{_SCALAR}{_WS}"
               rf"(?:,{_WS}{_SCALAR}{_WS}){{0,{MAX_DIMS - 1}}})?\])")
#: A flat object: at most an item's number of fields, each a scalar or a list of at most
#: `MAX_DIMS` scalars (what parsing it builds is as small as its text).
_FLAT_ITEM = re.compile(rf"\{{{_WS}(?:{_ITEM_FIELD}{_WS}(?:,{_WS}{_ITEM_FIELD}{_WS})"
                        rf"{{0,{len(_ITEM_FIELDS) - 1}}})?\}}", re.DOTALL)
#: A list of empty lists, or of lists that start with a list or object: no manifest has one
#: (the structure's lists hold nodes or [key, node] pairs; an item's, numbers).
_LIST_OF_LISTS = re.compile(rf"\[{_WS}(?:\]{_WS}(?:\]|,{_WS}[\[\]])|\[{_WS}[\[\]{{])")
#: JSON text up to the first string it does not hold whole.
_WHOLE_STRINGS = re.compile(rf'[^"]*+(?:{_STRING}[^"]*+)*+', re.DOTALL)
_STRING_AT = re.compile(_STRING, re.DOTALL)
_FILE_SIZE = rf'"{_BIN_FILE.pattern}"{_WS}:{_WS}\d++'
_FILE_NAMES = re.compile(rf'\[{_WS}(?:"{_BIN_FILE.pattern}"{_WS}'
                         rf'(?:,{_WS}"{_BIN_FILE.pattern}"{_WS})*+)?\]')
#: The start of the files: `{` and the members that are a bin file name and a size in digits.
_FILES = re.compile(rf"\{{{_WS}(?:{_FILE_SIZE}{_WS}(?:,{_WS}{_FILE_SIZE}{_WS})*+)?")


def _skip(text: str, at: int) -> int:
    """Where the JSON whitespace at `at` ends."""
    return _SPACE.match(text, at).end()  # type: ignore[union-attr]  # `*` always matches


class _Reader:
    """Reads a manifest's JSON field by field, refusing what no manifest holds before it is
    built: a field the format lacks (by its name), a list or object in a scalar field or a
    file size (by its first character), and an element of `items` that is not one flat
    object (`_FLAT_ITEM`).

    The files are parsed in one call where `_FILES` matches them, else member by member.
    Items are parsed one at a time, each in a slice of the text of at most `_CHUNK_CHARS`
    (so that no call parses more), or where one runs past its slice's end, alone once its
    shape is checked. The structure is parsed in one call, with each object checked as its
    node (`_structure_node`).
    """

    def __init__(self, text: str, fail: Callable[..., CorruptCheckpointError]) -> None:
        self._text = text
        self._fail = fail
        self._scan_scalar = json.JSONDecoder().scan_once
        self._scan_item = json.JSONDecoder(object_pairs_hook=_ItemHook(fail)).scan_once
        self._scan_node = json.JSONDecoder(  # not a method: the text must not live on in a cycle
            object_pairs_hook=functools.partial(_structure_node, fail)).scan_once

    def read(self) -> dict[str, Any]:
        """The manifest's fields by name: each at most once, and none other."""
        text = self._text
        at = _skip(text, 0)
        if not text.startswith("{", at):
            raise self._fail(f"expected a JSON object, found {self._found(at)}")
        body, at = self._members(at, "field", self._field)
        if _skip(text, at) != len(text):
            raise json.JSONDecodeError("Extra data", text, _skip(text, at))
        return body

    def _members(self, at: int, what: str, read: Callable[[str, int], tuple[Any, int]]
                 ) -> tuple[dict[str, Any], int]:
        """The object at `at` (its `{`) and its end: `read(name, at)` checks each member's name
        before it parses the value at `at`."""
        text = self._text
        members: dict[str, Any] = {}
        at = _skip(text, at + 1)
        if text.startswith("}", at):
            return members, at + 1
        while True:
            if not text.startswith('"', at):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes",
                                           text, at)
            name, at = _scanstring(text, at + 1)
            if name in members:
                raise self._fail(f"{what} {name!r}: expected once, found twice")
            at = _skip(text, at)
            if not text.startswith(":", at):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
            members[name], at = read(name, _skip(text, at + 1))
            at = _skip(text, at)
            if text.startswith("}", at):
                return members, at + 1
            if not text.startswith(",", at):
                raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
            at = _skip(text, at + 1)

    def _field(self, name: str, at: int) -> tuple[Any, int]:
        if name == "files":
            return self._files(at)
        if name == "items":
            return self._items(at)
        if name == "structure":
            if not self._text.startswith("{", at):
                raise self._fail(f"field 'structure': expected an object, found "
                                 f"{self._found(at)}")
            self._refuse_lists_of_lists(at)
            return self._scan(self._scan_node, at)
        if name == "shard":
            if not self._text.startswith("{", at):
                raise self._fail(f"field 'shard': expected an object, found {self._found(at)}")
            return self._members(at, "shard field", self._shard_member)
        if name not in _FIELDS:
            raise self._fail(f"field {brief(name)}: expected one of {list(_FIELDS)} (a "
                             f"manifest has no other)")
        if self._text.startswith(("[", "{"), at):
            raise self._fail(f"field {name!r}: expected a JSON scalar, found {self._found(at)}")
        return self._scan(self._scan_scalar, at)

    def _shard_member(self, name: str, at: int) -> tuple[Any, int]:
        """A member of `shard`: two scalars, and `store_files`, a flat list of bin file names
        (refused unless it is one before it is parsed)."""
        if name not in _SHARD_FIELDS:
            raise self._fail(f"shard field {brief(name)}: expected one of {list(_SHARD_FIELDS)}")
        if name == "store_files":
            if not _FILE_NAMES.match(self._text, at):
                raise self._fail("shard field 'store_files': expected a list of "
                                 "__<rank>_<bin>.distcp names")
        elif self._text.startswith(("[", "{"), at):
            raise self._fail(f"shard field {name!r}: expected a JSON scalar, found "
                             f"{self._found(at)}")
        return self._scan(self._scan_scalar, at)

    def _files(self, at: int) -> tuple[dict[str, Any], int]:
        """Parsed in one call once `_FILES` matches every member; else the first member it
        does not match is read alone (which names the fault), or all are, one by one."""
        text = self._text
        if not text.startswith("{", at):
            raise self._fail(f"field 'files': expected an object, found {self._found(at)}")
        matched = _FILES.match(text, at).end()  # type: ignore[union-attr]
        if text.startswith("}", matched):
            files, end = self._scan(self._scan_scalar, at)
            if len(files) != text.count(":", at, end):  # (no colon in a name or size)
                raise self._fail("field 'files': expected each file name once, found one "
                                 "listed twice")
            return files, end
        fault = _skip(text, matched + 1) if text.startswith(",", matched) else matched
        if text.startswith('"', fault):
            name, colon = _scanstring(text, fault + 1)
            colon = _skip(text, colon)
            if text.startswith(":", colon):
                self._file_size(name, _skip(text, colon + 1))
        return self._members(at, "file", self._file_size)  # spelled otherwise, e.g. escaped

    def _file_size(self, name: str, at: int) -> tuple[Any, int]:
        if not _BIN_FILE.fullmatch(name):
            raise self._fail(f"file name {brief(name)}: expected __<rank>_<bin>.distcp")
        if self._text.startswith(("[", "{"), at):
            raise self._fail(f"size of file {name!r}: expected a non-negative integer below "
                             f"2**63, found {self._found(at)}")
        return self._scan(self._scan_scalar, at)

    def _items(self, at: int) -> tuple[list[ItemRecord], int]:
        text = self._text
        if not text.startswith("[", at):
            raise self._fail(f"field 'items': expected a list, found {self._found(at)}")
        items: list[ItemRecord] = []
        at = _skip(text, at + 1)
        if text.startswith("]", at):
            return items, at + 1
        scan, chunk, base = self._scan_item, "", at
        while True:
            try:
                item, end = scan(chunk, at - base)
                end += base
            except (StopIteration, ValueError, RecursionError):  # past the slice, or malformed
                item, end = self._item_alone(at, len(items))
                base, chunk = end, text[end:text.rfind("}", end, end + _CHUNK_CHARS) + 1]
            if type(item) is not ItemRecord:  # not an object
                raise self._not_an_item(at, len(items))
            items.append(item)
            after = _NEXT_ITEM.match(text, end)
            if after is None:
                raise json.JSONDecodeError("Expecting ',' delimiter", text, end)
            at = after.end()
            if after.lastindex is None:  # the closing `]`
                return items, at

    def _item_alone(self, at: int, index: int) -> tuple[Any, int]:
        if not _FLAT_ITEM.match(self._text, at):
            raise self._not_an_item(at, index)
        return self._scan(self._scan_item, at)

    def _not_an_item(self, at: int, index: int) -> CorruptCheckpointError:
        found = "one that is not" if self._text.startswith("{", at) else self._found(at)
        return self._fail(f"item {index} at char {at}: expected a flat object (at most "
                          f"{len(_ITEM_FIELDS)} fields, each a scalar or a list of at most "
                          f"{MAX_DIMS} scalars), found {found}")

    def _refuse_lists_of_lists(self, at: int) -> None:
        """Refuse a list of empty or nested lists (`_LIST_OF_LISTS`) from `at` on, before it
        is parsed: a structure of them would cost more than any real one. One search; a match
        inside a string is passed over."""
        text = self._text
        while (found := _LIST_OF_LISTS.search(text, at)) is not None:
            outside = _WHOLE_STRINGS.match(text, at, found.start()).end()  # type: ignore[union-attr]
            if outside == found.start():
                raise self._fail(f"structure at char {outside}: expected nodes and [key, node] "
                                 "pairs, found a list of empty or nested lists")
            string = _STRING_AT.match(text, outside)  # the string holding the match
            if string is None:  # unterminated: the parser names it
                return
            at = string.end()

    def _scan(self, scan: Callable[[str, int], tuple[Any, int]], at: int) -> tuple[Any, int]:
        try:
            return scan(self._text, at)
        except StopIteration as exc:
            raise json.JSONDecodeError("Expecting value", self._text, exc.value) from None

    def _found(self, at: int) -> str:
        """The value at `at`, for an error message: a list or object is not parsed."""
        if self._text.startswith(("[", "{"), at):
            return "a list" if self._text[at] == "[" else "an object"
        return brief(self._scan(self._scan_scalar, at)[0])


def _structure_node(fail: Callable[..., CorruptCheckpointError],
                    pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The structure's `object_pairs_hook`: each object is a node of one known tag."""
    if len(pairs) != 1:
        raise fail(f"structure node of {len(pairs)} fields: expected an object with one tag")
    if pairs[0][0] not in _STRUCTURE_TAGS:
        raise fail(f"structure tag {brief(pairs[0][0])}: expected one of "
                   f"{sorted(_STRUCTURE_TAGS)}")
    return dict(pairs)


_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]


class _ItemHook:
    """The `object_pairs_hook` of `items`: each object becomes its `ItemRecord` at once
    (checked but for its file, bytes and checksum, which need the manifest's other fields),
    with shapes and names shared between items, so no dict per item is kept. A geometry
    (dtype and shapes) met before is not checked again (up to `_MAX_GEOMETRIES` of them).
    """

    def __init__(self, fail: Callable[..., CorruptCheckpointError]) -> None:
        self._fail = fail
        self._shared: dict[Any, Any] = {}
        #: (dtype, shape, global_shape, chunk_offsets) -> the bytes of a chunk of it
        self._geometries: dict[tuple[Any, ...], int] = {}

    def __call__(self, pairs: list[tuple[str, Any]]) -> ItemRecord:
        fail, raw = self._fail, dict(pairs)
        key = raw.get("key")
        if not isinstance(key, str) or "\x00" in key:
            raise fail(f"item key {brief(key)}: expected a string without NUL")
        if len(raw) != len(pairs) or not raw.keys() <= _ITEM_FIELDS:
            seen: set[str] = set()
            for name, _ in pairs:
                if name in seen or name not in _ITEM_FIELDS:
                    raise fail(f"item {key!r} field {brief(name)}: expected each of "
                               f"{sorted(_ITEM_FIELDS)} at most once", key)
                seen.add(name)
        kind, encoding = raw.get("kind"), raw.get("encoding", "raw")
        file, offset, nbytes = raw.get("file"), raw.get("offset"), raw.get("nbytes")
        if not isinstance(kind, str) or kind not in _KINDS:
            raise fail(f"item {key!r} kind {brief(kind)}: expected tensor, ndarray, bytes or "
                       "object", key)
        if encoding != ("torch_save" if kind == "object" else "raw"):
            raise fail(f"item {key!r} encoding {brief(encoding)}: expected torch_save for "
                       "objects, raw otherwise", key)
        if not (is_count(offset) and is_count(nbytes)):
            raise fail(f"item {key!r} bytes [{brief(offset)}, +{brief(nbytes)}): expected "
                       "non-negative integers below 2**63", key)
        file = self._share(file) if isinstance(file, str) else file
        if kind in ("bytes", "object"):
            return ItemRecord(key=key, kind=_KINDS[kind], file=file, offset=offset, nbytes=nbytes,
                              checksum=raw.get("checksum"), encoding=_ENCODINGS[encoding])
        dtype = raw.get("dtype")
        table = TORCH_DTYPES if kind == "tensor" else NUMPY_DTYPES
        if not isinstance(dtype, str) or dtype not in table:
            raise fail(f"item {key!r} dtype {brief(dtype)}: expected one of {sorted(table)}",
                       key)
        shape, global_shape = self._dims(raw.get("shape")), self._dims(raw.get("global_shape"))
        chunk_offsets = self._dims(raw.get("chunk_offsets"))
        if shape is None or global_shape is None or chunk_offsets is None or not (
                len(shape) == len(global_shape) == len(chunk_offsets)):
            raise fail(f"item {key!r}: expected shape, global_shape and chunk_offsets as lists "
                       f"of one length (at most {MAX_DIMS}) of integers in [0, 2**63)", key)
        geometry = (dtype, shape, global_shape, chunk_offsets)
        expected = self._geometries.get(geometry)
        if expected is None:
            expected = self._chunk_bytes(key, table[dtype].itemsize, *geometry[1:])
            if len(self._geometries) < _MAX_GEOMETRIES:
                self._geometries[geometry] = expected
        if expected != nbytes:
            raise fail(f"item {key!r}: expected {expected} bytes for {dtype} {list(shape)}, "
                       f"found nbytes {nbytes}", key)
        return ItemRecord(key=key, kind=_KINDS[kind], file=file, offset=offset, nbytes=nbytes,
                          checksum=raw.get("checksum"), dtype=self._share(dtype), shape=shape,
                          global_shape=global_shape, chunk_offsets=chunk_offsets)

    def _share(self, value: Any) -> Any:
        return self._shared.setdefault(value, value)

    def _dims(self, value: Any) -> tuple[int, ...] | None:
        if isinstance(value, list) and len(value) <= MAX_DIMS and all(map(is_count, value)):
            return self._share(tuple(value))
        return None

    def _chunk_bytes(self, key: str, itemsize: int, shape: tuple[int, ...],
                     global_shape: tuple[int, ...], chunk_offsets: tuple[int, ...]) -> int:
        """The bytes of a chunk of this geometry, once checked that it fits torch and lies
        inside its tensor."""
        check_fits(key, global_shape, itemsize, self._fail)
        if any(o + s > g for o, s, g in zip(chunk_offsets, shape, global_shape, strict=True)):
            raise self._fail(f"item {key!r} chunk at {list(chunk_offsets)} of shape "
                             f"{list(shape)}: expected inside global shape "
                             f"{list(global_shape)}", key)
        return math.prod(shape) * itemsize


#: At most this many geometries are remembered as checked (a few MiB).
_MAX_GEOMETRIES = 1 << 16


#: Each kind's and encoding's one string, which every record shares (not one per item).
_KINDS: dict[Any, ItemKind] = {kind: kind for kind in ("tensor", "ndarray", "bytes", "object")}
_ENCODINGS: dict[Any, Literal["raw", "torch_save"]] = {"raw": "raw", "torch_save": "torch_save"}


def _check_item_place(item: ItemRecord, files: dict[str, int], algorithm: str | None,
                      fail: Callable[..., CorruptCheckpointError]) -> None:
    """What the hook could not check of an item: its file, its bytes inside it, its checksum."""
    key, file = item.key, item.file
    if not isinstance(file, str) or file not in files:
        raise fail(f"item {key!r} file {brief(file)}: expected one of the manifest's files", key)
    if item.offset + item.nbytes > files[file]:
        raise fail(f"item {key!r} bytes [{item.offset}, +{item.nbytes}): expected inside "
                   f"{file} ({files[file]} bytes)", key)
    if not (is_digest(item.checksum) if algorithm is not None else item.checksum is None):
        expected = "16 lowercase hex digits" if algorithm is not None else "null"
        raise fail(f"item {key!r} checksum {brief(item.checksum)}: expected {expected} "
                   f"({algorithm})", key)


def check_fits(key: str, global_shape: tuple[int, ...], itemsize: int,
               fail: Callable[..., CorruptCheckpointError]) -> None:
    """Check that torch can make a tensor of `global_shape`: its byte size, counting empty
    dims as 1 (strides and offsets of an empty tensor are computed too), is below 2**63."""
    if math.prod(max(dim, 1) for dim in global_shape) * itemsize > MAX_INT64:
        raise fail(f"item {key!r} global_shape {list(global_shape)}: expected a shape torch can "
                   "hold (the product of its non-zero dims times the item size below 2**63)",
                   key)


def check_chunks(items: Sequence[ItemRecord],
                 fail: Callable[[str, str | None], CorruptCheckpointError], *,
                 whole: bool = True) -> None:
    """Check that each key's records agree (kind, dtype, global shape) and that its chunks
    tile the whole tensor: none overlaps another, and together they cover every element (not
    required of a shard's, unless `whole`: a shard holds its rank's chunks only).

    Near-linear in the number of chunks (`_tiles`), whatever their layout.

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
        if whole:
            _check_tiling(key, records, first.global_shape, fail)
        else:
            _check_disjoint(key, records, first.global_shape, fail)


def _group_by_key(items: Sequence[ItemRecord]) -> dict[str, list[ItemRecord]]:
    grouped: dict[str, list[ItemRecord]] = {}
    for item in items:
        grouped.setdefault(item.key, []).append(item)
    return grouped


#: Checking a tiling holds at most this many corner coordinates (int64) at once (64 MiB).
MAX_TILING_COORDINATES = 1 << 23
#: Naming an overlapping pair compares at most this many pairs of chunks.
MAX_OVERLAP_COMPARISONS = 1 << 20

_Box = tuple[tuple[int, ...], tuple[int, ...]]


def _check_tiling(key: str, records: list[ItemRecord], global_shape: tuple[int, ...],
                  fail: Callable[[str, str | None], CorruptCheckpointError]) -> None:
    """The chunks' volumes add up to the tensor's and their corners cancel to its own
    (`_tiles`); if not, the error names an overlapping pair (a bounded sweep) or the gap."""
    boxes: list[_Box] = [(r.chunk_offsets or (), r.shape or ()) for r in records
                         if 0 not in (r.shape or ())]
    if len(boxes) == 1 and boxes[0] == ((0,) * len(global_shape), global_shape):
        return  # one whole chunk: most items
    volume = math.prod(global_shape)
    covered = sum(math.prod(shape) for _, shape in boxes)
    if covered == volume and _tiles(key, boxes, global_shape, fail):
        return
    pair = _overlapping_pair(boxes)
    if pair is not None:
        (offsets, shape), (other_offsets, _) = pair
        raise fail(f"item {key!r}: chunk at {list(offsets)} of shape {list(shape)} overlaps "
                   f"the chunk at {list(other_offsets)}", key)
    if covered != volume:
        raise fail(f"item {key!r}: expected chunks covering all {volume} elements of shape "
                   f"{list(global_shape)}, found {covered}", key)
    raise fail(f"item {key!r}: expected chunks that do not overlap, found an overlap among "
               f"{len(boxes)} chunks (too many to name the pair)", key)


def _check_disjoint(key: str, records: list[ItemRecord], global_shape: tuple[int, ...],
                    fail: Callable[[str, str | None], CorruptCheckpointError]) -> None:
    """A shard's chunks of one tensor: none overlaps another (they need not cover it)."""
    boxes: list[_Box] = [(r.chunk_offsets or (), r.shape or ()) for r in records
                         if 0 not in (r.shape or ())]
    if len(boxes) < 2:
        return
    if sum(math.prod(shape) for _, shape in boxes) > math.prod(global_shape):
        raise fail(f"item {key!r}: expected chunks that do not overlap, found {len(boxes)} "
                   f"chunks holding more elements than shape {list(global_shape)}", key)
    try:
        pair = _overlapping_pair(boxes, exhaustive=True)
    except _TooManyComparisons:
        raise fail(f"item {key!r}: expected chunks whose overlaps at most "
                   f"{MAX_OVERLAP_COMPARISONS} comparisons rule out, found {len(boxes)} "
                   "chunks", key) from None
    if pair is not None:
        (offsets, shape), (other_offsets, _) = pair
        raise fail(f"item {key!r}: chunk at {list(offsets)} of shape {list(shape)} overlaps "
                   f"the chunk at {list(other_offsets)}", key)


def _tiles(key: str, boxes: list[_Box], global_shape: tuple[int, ...],
           fail: Callable[[str, str | None], CorruptCheckpointError]) -> bool:
    """Whether non-empty `boxes` (inside the tensor) tile it exactly.

    A box's indicator is the signed sum of the orthants at its 2**k corners (sign -1 per upper
    coordinate), so the boxes tile the tensor exactly (every element covered once) iff the
    signs summed at each point cancel but at the tensor's own corners. Only the k dims some box
    does not span are looked at; sorting the n * 2**k corners makes it O(n log n) for a given
    k (k is 1 or 2 for real shardings).
    """
    split = [dim for dim, size in enumerate(global_shape)
             if any(offsets[dim] or shape[dim] != size for offsets, shape in boxes)]
    k = len(split)
    if not k:  # every box spans the tensor: one, or none for an empty tensor
        return len(boxes) <= 1
    if (len(boxes) << k) * k > MAX_TILING_COORDINATES:
        raise fail(f"item {key!r}: {len(boxes)} chunks split along {k} dims: expected at most "
                   f"{MAX_TILING_COORDINATES} corner coordinates to check their tiling, found "
                   f"{(len(boxes) << k) * k}", key)
    low = np.array([[offsets[dim] for dim in split] for offsets, _ in boxes], dtype=np.int64)
    high = low + np.array([[shape[dim] for dim in split] for _, shape in boxes], dtype=np.int64)
    upper = (np.arange(1 << k)[:, None] >> np.arange(k) & 1).astype(bool)  # corner -> dims
    signs = 1 - 2 * (upper.sum(axis=1) % 2)
    corners = np.where(upper[:, None, :], high, low).reshape(-1, k)
    found = _signed_points(corners, np.repeat(signs, len(boxes)))
    expected = _signed_points(np.where(upper, [global_shape[dim] for dim in split], 0), signs)
    return all(np.array_equal(a, b) for a, b in zip(found, expected, strict=True))


def _signed_points(points: np.ndarray, signs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct points (rows, sorted) whose signs do not sum to 0, and their sums."""
    order = np.lexsort(points.T[::-1])
    points, signs = points[order], signs[order]
    starts = np.flatnonzero(np.r_[True, (points[1:] != points[:-1]).any(axis=1)])
    sums = np.add.reduceat(signs, starts)
    return points[starts[sums != 0]], sums[sums != 0]


class _TooManyComparisons(Exception):
    """`_overlapping_pair` ran out of its budget before it could tell."""


def _overlapping_pair(boxes: list[_Box], *, exhaustive: bool = False
                      ) -> tuple[_Box, _Box] | None:
    """Two overlapping boxes, if a sweep finds them within `MAX_OVERLAP_COMPARISONS`: along
    the dim where the boxes start at the most places, comparing only boxes that meet in it.
    Past the budget: None, or with `exhaustive`, `_TooManyComparisons`."""
    if not boxes or not boxes[0][0]:  # 0-dim: any two overlap
        return (boxes[1], boxes[0]) if len(boxes) > 1 else None
    dim = max(range(len(boxes[0][0])), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    active: list[_Box] = []
    budget = MAX_OVERLAP_COMPARISONS
    for offsets, shape in sorted(boxes, key=lambda box: box[0][dim]):
        active = [(o, s) for o, s in active if o[dim] + s[dim] > offsets[dim]]
        for other_offsets, other_shape in active:
            if all(a < b + m and b < a + n for a, n, b, m in zip(
                    offsets, shape, other_offsets, other_shape, strict=True)):
                return (offsets, shape), (other_offsets, other_shape)
        budget -= len(active) + 1
        if budget < 0:
            if exhaustive:
                raise _TooManyComparisons
            return None
        active.append((offsets, shape))
    return None


def is_count(value: Any) -> bool:
    """Whether a parsed value is an int (not a bool) in [0, 2**63)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT64


def _check_structure(structure: Any, keys: set[str], fail: Any, *, whole: bool = True) -> None:
    """Walk the structure iteratively (hostile nesting cannot overflow the stack): every item
    is referenced, and (`whole`) every reference is to an item (a shard's may name items that
    other shards hold)."""
    referenced: set[str] = set()
    stack = [structure]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):  # each dict is a node of one tag (`_structure_node`)
            raise fail(f"structure node {brief(node)}: expected an object with one tag")
        (tag, body), = node.items()
        if tag == "item":
            if not isinstance(body, str) or (whole and body not in keys):
                raise fail(f"structure references item {brief(body)}, which the manifest lacks")
            referenced.add(body)
        elif tag == "dict":
            if not isinstance(body, list):
                raise fail("structure dict: expected a list of [key, node] pairs")
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(
                        pair[0], str | int) and not isinstance(pair[0], bool)):
                    raise fail(f"structure dict entry {brief(pair)}: expected [key, node]")
                stack.append(pair[1])
        elif tag in ("list", "tuple"):
            if not isinstance(body, list):
                raise fail(f"structure {tag}: expected a list")
            stack.extend(body)
        elif tag == "value" and isinstance(body, dict | list):
            raise fail("structure value: expected a JSON scalar")
    if not keys <= referenced:
        missing = sorted(keys - referenced)[:3]
        raise fail(f"items {missing} are not referenced by the structure")


def brief(value: Any) -> str:
    """`value` for an error message: the repr of a short string or an int of up to 64 bits,
    else its type and length. Bounded time and length, where a hostile value's own repr could
    be gigabytes (or exponential, for shared nesting unpickled from a DCP `.metadata`)."""
    if isinstance(value, str):
        text = str.__str__(value)
        return repr(text) if len(text) <= 64 else f"{text[:48]!r}... ({len(text)} chars)"
    if isinstance(value, int):
        number = int(value)
        return repr(number) if number.bit_length() <= 64 else f"<int of {number.bit_length()} bits>"
    if value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}>"


class _GcPause:
    """Pauses the cyclic garbage collector while metadata is parsed (see `paused_gc`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_pauses = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if not self._num_pauses:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._num_pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._num_pauses -= 1
                if not self._num_pauses and self._was_enabled:
                    gc.enable()


paused_gc = _GcPause()
"""Context manager: no garbage collection (process-wide) until the last of the overlapping
pauses ends. Parsing metadata makes millions of objects and no cycles: collections then only
walk every object in the process, again and again as the parse grows them (half a 100k-item
manifest's parse time; quadratic in junk containers). Cycles other threads make meanwhile wait
for the next collection after it."""
