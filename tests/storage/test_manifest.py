"""The manifest parser: a key's chunks must tile its tensor (overlaps and gaps refused, in
near-linear time), and hostile bytes cost bounded time and memory with short error messages."""

from __future__ import annotations

import gc
import json
import math
import tracemalloc

import pytest

from asynctron.errors import CorruptCheckpointError
from asynctron.storage.format import _manifest
from asynctron.storage.format._manifest import (
    ItemRecord,
    check_chunks,
    encode_manifest,
    parse_manifest,
)


def _tile(offsets: tuple[int, int], shape: tuple[int, int] = (2, 2)) -> ItemRecord:
    return ItemRecord(key="w", kind="tensor", file="__0_0.distcp", offset=0,
                      nbytes=4 * shape[0] * shape[1], checksum=None, dtype="float32",
                      shape=shape, global_shape=(4, 4), chunk_offsets=offsets)


def _fail(what: str, key: str | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(what, path="manifest.json", key=key)


def test_four_tiles_of_a_square_pass() -> None:
    check_chunks([_tile((0, 0)), _tile((0, 2)), _tile((2, 0)), _tile((2, 2))], _fail)


def test_many_row_chunks_pass_quickly() -> None:
    rows = [ItemRecord(key="w", kind="tensor", file="__0_0.distcp", offset=0, nbytes=32,
                       checksum=None, dtype="float32", shape=(1, 8), global_shape=(20_000, 8),
                       chunk_offsets=(i, 0)) for i in range(20_000)]
    check_chunks(rows, _fail)


@pytest.mark.parametrize(("tiles", "message"), [
    ([_tile((0, 0)), _tile((0, 2)), _tile((2, 0)), _tile((1, 1))],
     r"item 'w': chunk at \[1, 1\] of shape \[2, 2\] overlaps the chunk at \[0, 0\]"),
    ([_tile((0, 0)), _tile((0, 2)), _tile((2, 0))],
     r"item 'w': expected chunks covering all 16 elements of shape \[4, 4\], found 12"),
    ([_tile((0, 0), (4, 2)), _tile((0, 2), (4, 2)), _tile((2, 2))],
     r"item 'w': chunk at \[2, 2\] of shape \[2, 2\] overlaps the chunk at \[0, 2\]"),
])
def test_overlaps_and_gaps_are_refused_naming_the_key(tiles: list[ItemRecord],
                                                      message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=rf"^{message}") as raised:
        check_chunks(tiles, _fail)
    assert raised.value.key == "w"


def _box(offsets: tuple[int, ...], shape: tuple[int, ...],
         global_shape: tuple[int, ...]) -> ItemRecord:
    return ItemRecord(key="w", kind="tensor", file="__0_0.distcp", offset=0,
                      nbytes=4 * math.prod(shape), checksum=None, dtype="float32", shape=shape,
                      global_shape=global_shape, chunk_offsets=offsets)


def test_column_chunks_are_checked_in_near_linear_time() -> None:
    """100k chunks that all span dim 0 (a column-sharded tensor): a sweep along dim 0 would
    compare every pair (5e9 comparisons, hours: the test's time limit); near-linear takes
    well under a second."""
    columns = [_box((0, i), (1, 1), (1, 100_000)) for i in range(100_000)]
    check_chunks(columns, _fail)


def _grid(n: int) -> list[ItemRecord]:
    return [_box((2 * i, 2 * j, 2 * k), (2, 2, 2), (2 * n,) * 3)
            for i in range(n) for j in range(n) for k in range(n)]


def test_a_3d_grid_tiles_and_a_missing_or_moved_box_is_refused() -> None:
    check_chunks(_grid(8), _fail)
    with pytest.raises(CorruptCheckpointError, match=r"^item 'w': expected chunks covering all "
                                                     r"4096 elements of shape \[16, 16, 16\], "
                                                     r"found 4088$"):
        check_chunks(_grid(8)[1:], _fail)
    moved = _grid(8)
    moved[5] = _box((1, 1, 1), (2, 2, 2), (16,) * 3)  # same volume: a gap and an overlap
    with pytest.raises(CorruptCheckpointError, match=r"^item 'w': chunk at \[\d+, \d+, \d+\] of "
                                                     r"shape \[2, 2, 2\] overlaps the chunk at "):
        check_chunks(moved, _fail)


def test_overlapping_column_chunks_are_refused_quickly() -> None:
    columns = [_box((0, i), (1, 1), (1, 100_000)) for i in range(100_000)]
    columns[50_000] = _box((0, 49_999), (1, 1), (1, 100_000))
    with pytest.raises(CorruptCheckpointError, match=r"^item 'w': "):
        check_chunks(columns, _fail)


def _manifest_json(num_items: int) -> bytes:
    items = [ItemRecord(key=f"model.layers.{i}.w", kind="tensor", file="__0_0.distcp",
                        offset=64 * i, nbytes=16, checksum="0123456789abcdef", dtype="float32",
                        shape=(4,), global_shape=(4,), chunk_offsets=(0,))
             for i in range(num_items)]
    structure = json.dumps({"dict": [[item.key, {"item": item.key}] for item in items]})
    return encode_manifest(structure=structure, items=items, checksums=None,
                           files={"__0_0.distcp": 64 * num_items}, created_unix_s=1.0,
                           checksum="xxh3_64")


def test_parsing_pauses_the_garbage_collector() -> None:
    """The parse makes only acyclic objects: collections would walk every object in the
    process, again and again as the parse grows them (1574 times for 100k items, half the
    parse's time). One young-generation collection may follow the pause."""
    data = _manifest_json(100_000)
    collections: list[str] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(phase)

    gc.callbacks.append(count)
    try:
        manifest = parse_manifest(data, "m.json")
    finally:
        gc.callbacks.remove(count)
    assert len(manifest.items) == 100_000 and len(collections) <= 1


def test_non_ascii_bytes_are_refused_naming_the_offset() -> None:
    """asynctron writes every non-ASCII character escaped; one raw multi-byte character would
    make the decoded text 4 bytes a character."""
    data = _manifest_json(2).replace(b'"model.layers.1.w"', '"é"'.encode())
    offset = data.index("é".encode())
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^manifest m\.json: byte {offset}: expected ASCII JSON \(asynctron "
                             r"escapes every other character\), found 0xc3; "):
        parse_manifest(data, "m.json")


@pytest.mark.parametrize("value", ["x" * 10_000_000, 10**4000], ids=["long string", "huge int"])
def test_errors_show_a_bounded_part_of_a_hostile_value(value: object) -> None:
    data = _manifest_json(2).replace(b'"format":"asynctron"',
                                     b'"format":' + json.dumps(value).encode())
    with pytest.raises(CorruptCheckpointError, match=r"^manifest m\.json: expected format "
                                                     r"'asynctron', found ") as raised:
        parse_manifest(data, "m.json")
    assert len(str(raised.value)) < 300


@pytest.mark.parametrize(("value", "shown"), [(b"1e999", "inf"), (b"-1", "-1"),
                                             (b"1" + b"0" * 400, "<int of 1329 bits>")])
def test_a_creation_time_datetime_cannot_show_is_refused(value: bytes, shown: str) -> None:
    data = _manifest_json(2).replace(b'"created_unix_s":1.0', b'"created_unix_s":' + value)
    with pytest.raises(CorruptCheckpointError, match=rf"^manifest m\.json: field 'created_unix_s': "
                                                     r"expected seconds since 1970 up to the year "
                                                     rf"9999, found {shown}; "):
        parse_manifest(data, "m.json")


def _peak_bytes_to_refuse(data: bytes, message: str) -> int:
    """Parse `data`, expecting a refusal matching `message`; the parse's peak Python memory."""
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=message) as raised:
            parse_manifest(data, "m.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(str(raised.value)) < 400
    return peak


_HEAD = (b'{"format":"asynctron","version":1,"created_unix_s":1.0,"checksum":null,'
         b'"files":{"__0_0.distcp":1024}')
_JUNK = b"[" + b",".join([b"[]"] * 2_000_000) + b"]"  # 6 MB: 2M lists of 64 bytes if built


@pytest.mark.parametrize(("data", "message"), [
    (_HEAD + b',"junk":' + _JUNK + b',"items":[],"structure":{"dict":[]}}',
     r"^manifest m\.json: field 'junk': expected one of \['format', 'version', "
     r"'created_unix_s', 'checksum', 'files', 'items', 'structure', 'shard'\] \(a manifest has no "
     r"other\); "),
    (_HEAD + b',"items":' + _JUNK + b',"structure":{"dict":[]}}',
     r"^manifest m\.json: item 0 at char 110: expected a flat object \(at most 11 fields, each "
     r"a scalar or a list of at most 64 scalars\), found a list; "),
    (_HEAD + b',"items":[{"key":"k","kind":"tensor","shape":' + _JUNK + b'}],'
     b'"structure":{"dict":[]}}', r"^manifest m\.json: item 0 at char 110: expected a flat "
                                  r"object .*, found one that is not; "),
    (_HEAD + b',"items":[],"structure":{"list":' + _JUNK + b"}}",
     r"^manifest m\.json: structure at char 132: expected nodes and \[key, node\] pairs, "
     r"found a list of empty or nested lists; "),
    (_HEAD[:-5] + _JUNK + b"}}", r"^manifest m\.json: size of file '__0_0\.distcp': expected a "
                                r"non-negative integer below 2\*\*63, found a list; "),
    (b'{"format":' + _JUNK + b"}", r"^manifest m\.json: field 'format': expected a JSON "
                                   r"scalar, found a list; "),
], ids=["an extra field", "items", "an item's shape", "the structure", "a file size",
        "a scalar field"])
def test_a_list_of_empty_lists_is_refused_unbuilt_naming_the_field(data: bytes,
                                                                   message: str) -> None:
    """Anywhere in a manifest, 2M empty lists (6 MB of JSON; 128 MB once built) are refused
    before they are built: the parse holds the text and little more."""
    assert _peak_bytes_to_refuse(data, message) < 2 * len(data)


@pytest.mark.parametrize(("data", "message"), [
    (_HEAD + b',"items":[{},{}]}', r"^manifest m\.json: item key None: expected a string "),
    (_HEAD + b',"items":[{"key":"k","junk":[]}]}',
     r"^manifest m\.json: item 'k' field 'junk': expected each of \['checksum', "),
    (_HEAD + b',"items":[{"key":"k","key":"k"}]}', r"^manifest m\.json: item 'k' field 'key': "
                                                   r"expected each of "),
    (_HEAD + b',"items":[7]}', r"^manifest m\.json: item 0 at char 110: expected a flat "
                               r"object .*, found 7; "),
    (_HEAD + b',"structure":{"list":[{}]}}', r"^manifest m\.json: structure node of 0 fields: "
                                             r"expected an object with one tag; "),
    (_HEAD + b',"structure":{"list":[{"dict":[],"list":[]}]}}',
     r"^manifest m\.json: structure node of 2 fields: expected an object with one tag; "),
    (_HEAD + b',"structure":{"junk":0}}', r"^manifest m\.json: structure tag 'junk': "
                                          r"expected one of \['dict', 'item', 'list', "),
    (_HEAD + b',"files":{}}', r"^manifest m\.json: field 'files': expected once, found twice; "),
    (_HEAD[:-1] + b',"__0_0.distcp":1}}', r"^manifest m\.json: field 'files': expected each "
                                         r"file name once, found one listed twice; "),
    (_HEAD[:-1] + b',"__0_\\u0030.distcp":1}}', r"^manifest m\.json: file '__0_0\.distcp': "
                                                r"expected once, found twice; "),
    (_HEAD[:-1] + b',"../x":1}}', r"^manifest m\.json: file name '\.\./x': expected "
                                  r"__<rank>_<bin>\.distcp; "),
    (_HEAD + b"}[]", r"^manifest m\.json: expected JSON, found JSONDecodeError: 'Extra data: "),
    (b"[]", r"^manifest m\.json: expected a JSON object, found a list; "),
], ids=["empty objects", "an unknown item field", "an item field twice", "a number item",
        "an empty node", "a node of two tags", "an unknown tag", "a field twice", "a file twice",
        "a file spelled twice", "a file outside the checkpoint", "extra data", "a list"])
def test_what_no_manifest_holds_is_refused_naming_it(data: bytes, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_manifest(data, "m.json")


def _record(key: str, offset: int, shape: tuple[int, ...] = (4,)) -> ItemRecord:
    return ItemRecord(key=key, kind="tensor", file="__0_0.distcp", offset=offset,
                      nbytes=4 * math.prod(shape), checksum=None, dtype="float32", shape=shape,
                      global_shape=shape, chunk_offsets=(0,) * len(shape))


@pytest.mark.parametrize("chunk_chars", [64, 1000, _manifest._CHUNK_CHARS])
def test_real_manifests_round_trip_whatever_their_keys_layout_and_spacing(
        monkeypatch: pytest.MonkeyPatch, chunk_chars: int) -> None:
    """Keys that look like the JSON the reader refuses or cuts at (braces, lists of lists,
    escapes), 0-dim tensors, items across many slices of the text (of `chunk_chars`), the
    fields in another order and spaced as `json.dumps` spaces them: each parses to the same
    manifest."""
    monkeypatch.setattr(_manifest, "_CHUNK_CHARS", chunk_chars)
    odd = ["a}b", "[[],[]]", "x,[[{", '"q"', "\\", "\u00e9", "{}", "[]", ""]
    items = [_record(key, 16 * i) for i, key in enumerate(odd)]
    items += [_record(f"scalar.{i}", 16 * len(odd) + 4 * i, ()) for i in range(3)]
    items += [_record(f"model.layers.{i}." + "w" * 200, 1024 + 16 * i) for i in range(10_000)]
    structure = json.dumps({"dict": [[item.key, {"item": item.key}] for item in items]
                            + [["k", {"list": [{"list": []}, {"value": None}]}]]},
                           separators=(",", ":"))
    data = encode_manifest(structure=structure, items=items, checksums=None,
                           files={"__0_0.distcp": 1 << 20}, created_unix_s=1.0, checksum=None)
    manifest = parse_manifest(data, "m.json")
    assert manifest.items == tuple(items) and manifest.to_json() == data
    fields = json.loads(data)
    reordered = json.dumps({name: fields[name] for name in reversed(list(fields))}).encode()
    assert parse_manifest(reordered, "m.json") == manifest
    spaced = json.dumps(fields, indent=1).encode()
    assert parse_manifest(spaced, "m.json") == manifest


def _shard_manifest(tiles: list[ItemRecord], *, rank: int = 1, world_size: int = 4,
                    store_files: tuple[str, ...] = ("__0_0.distcp",),
                    structure: str = '{"dict":[["w",{"item":"w"}],["b",{"item":"b"}]]}',
                    shard: bool = True) -> bytes:
    from asynctron.storage.format import ShardInfo

    return encode_manifest(structure=structure, items=tiles, checksums=None,
                           files={"__0_0.distcp": 1 << 20}, created_unix_s=1.0, checksum=None,
                           shard=ShardInfo(rank=rank, world_size=world_size,
                                           store_files=store_files) if shard else None)


def test_a_shard_holds_part_of_a_tensor_and_names_items_other_shards_hold() -> None:
    """A tier's shard: its chunks need not cover the tensor, its structure may name keys
    only other shards hold; it says whose part it is and which files the store takes."""
    manifest = parse_manifest(_shard_manifest([_tile((0, 0)), _tile((2, 2))]), "m.json")
    assert manifest.shard is not None
    assert (manifest.shard.rank, manifest.shard.world_size) == (1, 4)
    assert manifest.shard.store_files == ("__0_0.distcp",)
    assert parse_manifest(manifest.to_json(), "again.json") == manifest
    with pytest.raises(CorruptCheckpointError, match=r"expected chunks covering all 16"):
        parse_manifest(_shard_manifest([_tile((0, 0))], shard=False,
                                       structure='{"dict":[["w",{"item":"w"}]]}'), "m.json")


@pytest.mark.parametrize(("fields", "message"), [
    ({"tiles": [_tile((0, 0)), _tile((1, 1))]},
     r"item 'w': chunk at \[1, 1\] of shape \[2, 2\] overlaps the chunk at \[0, 0\]"),
    ({"rank": 4}, r"field 'shard': expected 0 <= rank < world_size, found rank 4 of "
                  r"world_size 4"),
    ({"store_files": ("__0_9.distcp",)}, r"field 'shard': store file '__0_9.distcp': "
                                         r"expected one of the manifest's files"),
    ({"store_files": ("__0_0.distcp", "__0_0.distcp")}, r"expected each store file once"),
    ({"structure": '{"dict":[]}'}, r"items \['w'\] are not referenced by the structure"),
])
def test_a_bad_shard_is_refused_naming_the_fault(fields: dict, message: str) -> None:
    tiles = fields.pop("tiles", [_tile((0, 0))])
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_manifest(_shard_manifest(tiles, **fields), "m.json")


@pytest.mark.parametrize(("shard", "message"), [
    (b'{"rank":0,"world_size":1,"junk":1}', r"shard field 'junk': expected one of"),
    (b'{"rank":0,"world_size":1,"store_files":[["x"]]}',
     r"shard field 'store_files': expected a list of __<rank>_<bin>.distcp names"),
    (b'{"rank":[0],"world_size":1}', r"shard field 'rank': expected a JSON scalar"),
    (b"[]", r"field 'shard': expected an object, found a list"),
])
def test_a_hostile_shard_field_is_refused_unbuilt(shard: bytes, message: str) -> None:
    data = _shard_manifest([_tile((0, 0))]).replace(
        b'"shard":{"rank":1,"world_size":4,"store_files":["__0_0.distcp"]}', b'"shard":' + shard)
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_manifest(data, "m.json")
