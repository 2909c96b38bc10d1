"""Stock torch.distributed.checkpoint checkpoints: asynctron reads them, never unpickling
anything but DCP's metadata types and plain values."""

from __future__ import annotations

import argparse
import collections
import copyreg
import datetime
import io
import json
import os
import pathlib
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import uvloop
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from asynctron import CorruptCheckpointError, Engine, RefusedObjectError
from asynctron.cli import main
from asynctron.storage.backends.local._reader import read_dcp_manifest
from asynctron.storage.format._dcp import check_object_blob, decode_blob
from tests.conftest import assert_same


def _stock_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(8, 4, generator=g), "b": torch.arange(5),
                  "h": torch.randn(3, generator=g).to(torch.bfloat16)},
        "optim": {"state": {0: {"exp_avg": torch.randn(8, 4, generator=g), "step": 3}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "step": 7, "name": "run-1", "blob": b"\x00\x01",
        "layers": [torch.ones(2), torch.zeros(2, 2)],
    }


def _save_stock(path: str, state: dict) -> None:
    dcp.save(state, checkpoint_id=path, no_dist=True)


async def test_fresh_load_rebuilds_the_nesting_bit_exact(tmp_path: object) -> None:
    state = _stock_state()
    _save_stock(f"{tmp_path}/dcp", state)
    async with Engine() as engine:
        loaded = await engine.load(f"{tmp_path}/dcp")
        mapped = await engine.load(f"{tmp_path}/dcp", mmap=True)
    # DCP stores dict keys as strings (list indices stay ints): the int key comes back as '0'.
    state["optim"]["state"] = {"0": state["optim"]["state"][0]}
    assert_same(state, loaded)
    assert_same(state, mapped)


async def test_load_into_fills_tensors_and_takes_values(tmp_path: object) -> None:
    state = _stock_state()
    _save_stock(f"{tmp_path}/dcp", state)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "step": 0, "layers": [torch.empty(2), torch.empty(2, 2).t()]}
    async with Engine() as engine:
        result = await engine.load_into(target, f"{tmp_path}/dcp")
    assert result["step"] == 7
    assert_same(state["model"], target["model"])
    assert_same(state["layers"], [target["layers"][0], target["layers"][1].contiguous()])


async def test_numpy_values_load_without_arbitrary_unpickling(tmp_path: object) -> None:
    state = {"arr": np.arange(6, dtype=np.int32).reshape(2, 3), "w": torch.ones(2)}
    _save_stock(f"{tmp_path}/dcp", state)
    loaded = await _load(f"{tmp_path}/dcp")
    assert np.array_equal(loaded["arr"], state["arr"]) and loaded["arr"].dtype == np.int32


class Gadget:
    """A class that must never be instantiated by a load."""


@pytest.mark.usefixtures("default_safe_globals")
async def test_an_item_holding_a_foreign_class_is_refused_by_name(tmp_path: object) -> None:
    _save_stock(f"{tmp_path}/dcp", {"gadget": Gadget(), "w": torch.ones(2)})
    with pytest.raises(RefusedObjectError,
                       match=r"^item 'gadget' in .*__0_0\.distcp: holds .*Gadget, which "
                             r"asynctron does not unpickle .* the item is not "
                             r"damaged\. .*torch\.serialization\.add_safe_globals") as raised:
        await _load(f"{tmp_path}/dcp")
    assert isinstance(raised.value, TypeError | CorruptCheckpointError)
    assert raised.value.key == "gadget"


def _blob(value: object) -> memoryview:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getbuffer()


@pytest.mark.parametrize("value", [
    np.float64(2.5), np.float32(1.5), np.int64(-3), np.bool_(True), np.uint32(7),
    np.complex128(1 + 2j), np.random.RandomState(0).get_state(), np.dtype("uint16"),
    np.arange(6, dtype=np.uint32).reshape(2, 3), np.zeros(2, dtype=np.float16),
], ids=lambda value: type(value).__name__)
def test_numpy_scalars_dtypes_and_arrays_decode(value: object) -> None:
    check_object_blob(_blob(value), key="v")
    decoded = decode_blob(_blob(value), key="v", path="f")
    if isinstance(value, tuple):  # np.random.get_state(): (name, keys, pos, has_gauss, gauss)
        assert decoded[0] == value[0] and decoded[2:] == value[2:]
        np.testing.assert_array_equal(decoded[1], value[1])
    else:
        assert type(decoded) is type(value)
        if not isinstance(value, np.dtype):
            np.testing.assert_array_equal(decoded, value)
            assert decoded.dtype == value.dtype


@pytest.mark.parametrize(("value", "names"), [
    (datetime.datetime(2020, 1, 1), "datetime.datetime"),
    (argparse.Namespace(a=1), "argparse.Namespace"),
    (slice(1, 2), "builtins.slice"),
    (np.array(["a"], dtype=object), "ObjectDType"),
    (Gadget(), "Gadget"),
], ids=["datetime", "Namespace", "slice", "object array", "class"])
@pytest.mark.usefixtures("default_safe_globals")
def test_refused_globals_are_named_with_the_way_to_allow_them(value: object, names: str) -> None:
    with pytest.raises(RefusedObjectError, match=rf"item 'v' in f: holds .*{re.escape(names)}"):
        decode_blob(_blob(value), key="v", path="f")
    with pytest.raises(TypeError, match=rf"^value at key 'v': holds .*{re.escape(names)}, which "
                                        r"asynctron's reader does not unpickle .*"
                                        r"torch\.serialization\.add_safe_globals"):
        check_object_blob(_blob(value), key="v")


@pytest.mark.usefixtures("default_safe_globals")
def test_safe_globals_the_user_adds_are_admitted() -> None:
    value = datetime.datetime(2020, 1, 1)
    with torch.serialization.safe_globals([datetime.datetime]):
        check_object_blob(_blob(value), key="v")
        assert decode_blob(_blob(value), key="v", path="f") == value


def test_a_damaged_blob_is_still_corrupt_not_refused() -> None:
    blob = bytes(_blob({"a": 1}))
    with pytest.raises(CorruptCheckpointError, match=r"the item is damaged") as raised:
        decode_blob(memoryview(blob[:len(blob) // 2]), key="v", path="f")
    assert not isinstance(raised.value, RefusedObjectError)


class _Exploit:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch pwned",))


async def test_a_hostile_metadata_pickle_is_refused_before_running_anything(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    _save_stock(f"{tmp_path}/dcp", {"w": torch.ones(2)})
    with open(f"{tmp_path}/dcp/.metadata", "wb") as f:
        pickle.dump(_Exploit(), f)
    monkeypatch.chdir(str(tmp_path))
    with pytest.raises(CorruptCheckpointError,
                       match=r"^metadata .*/\.metadata: expected only DCP metadata types, found "
                             r"global posix\.system; refusing to unpickle it$"):
        await _load(f"{tmp_path}/dcp")
    assert not os.path.exists(f"{tmp_path}/pwned")


async def test_an_item_outside_its_file_is_refused(tmp_path: object) -> None:
    _save_stock(f"{tmp_path}/dcp", {"w": torch.ones(1000)})
    os.truncate(f"{tmp_path}/dcp/__0_0.distcp", 100)
    with pytest.raises(CorruptCheckpointError,
                       match=r"^metadata .*: item 'w' bytes \[0, \+\d+\): expected inside "
                             r"__0_0\.distcp \(100 bytes\)"):
        await _load(f"{tmp_path}/dcp")


def _rewrite_metadata(path: str, edit: object) -> None:
    """Unpickle a test checkpoint's own (trusted) `.metadata`, `edit` it, pickle it back."""
    with open(f"{path}/.metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)  # type: ignore[operator]
    with open(f"{path}/.metadata", "wb") as f:
        pickle.dump(metadata, f)


def _declare(metadata: Metadata, size: list[int], chunks: list[list[int]],
             sources: list[str]) -> None:
    """Make key 'w' a float32 tensor of `size` whose chunks (at `chunks`, each of the size
    the next offset leaves) are stored in the blobs of keys `sources`."""
    bounds = [*(offsets[0] for offsets in chunks), size[0]]
    metadata.state_dict_metadata = {"w": _tensor_entry(size, [
        _chunk(offsets, [bounds[i + 1] - offsets[0], *size[1:]])
        for i, offsets in enumerate(chunks)])}
    blobs = {index.fqn: info for index, info in metadata.storage_data.items()}
    metadata.storage_data = {MetadataIndex("w", offsets): blobs[source]
                             for offsets, source in zip(chunks, sources, strict=True)}
    metadata.planner_data = {"w": ("w",)}


async def test_a_declared_size_beyond_the_stored_bytes_is_refused_before_allocating(
        tmp_path: object) -> None:
    """An 8 TiB tensor declared in two chunks stored as two blobs of 16 bytes."""
    _save_stock(f"{tmp_path}/dcp", {"a": torch.ones(4), "b": torch.ones(4)})
    _rewrite_metadata(f"{tmp_path}/dcp", lambda m: _declare(m, [1 << 41], [[0], [1 << 40]],
                                                            ["a", "b"]))
    with pytest.raises(CorruptCheckpointError,
                       match=r"^metadata .*: item 'w' chunk at \[0\] in __0_0\.distcp: "
                             r"expected a torch\.save blob of at least 4398046511104 bytes for "
                             r"float32 \[1099511627776\], found \d+; "):
        await _load(f"{tmp_path}/dcp")


async def test_an_empty_tensor_of_a_shape_torch_cannot_hold_is_refused(tmp_path: object) -> None:
    _save_stock(f"{tmp_path}/dcp", {"a": torch.ones(4)})
    _rewrite_metadata(f"{tmp_path}/dcp", lambda m: _declare(m, [0, 1 << 62, 1 << 62], [[0, 0, 0]],
                                                            ["a"]))
    with pytest.raises(CorruptCheckpointError,
                       match=r"^metadata .*: item 'w' global_shape \[0, 4611686018427387904, "
                             r"4611686018427387904\]: expected a shape torch can hold"):
        await _load(f"{tmp_path}/dcp")


@pytest.mark.parametrize("target", [".metadata", "__0_0.distcp"])
async def test_a_linked_file_is_refused_not_followed(tmp_path: object, target: str) -> None:
    _save_stock(f"{tmp_path}/dcp", {"w": torch.ones(4)})
    os.rename(f"{tmp_path}/dcp/{target}", f"{tmp_path}/outside")
    os.symlink(f"{tmp_path}/outside", f"{tmp_path}/dcp/{target}")
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^file {tmp_path}/dcp/{target}: expected a regular file, found a "
                             r"symbolic link; "):
        await _load(f"{tmp_path}/dcp")


def test_verify_decodes_every_blob_as_a_load_would(tmp_path: object,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _save_stock(f"{tmp_path}/dcp", {"w": torch.ones(4), "step": 3})
    assert main(["verify", f"{tmp_path}/dcp"]) == 0
    assert capsys.readouterr().out == (f"checkpoint {tmp_path}/dcp: saved without checksums; 2 "
                                       "torch.save items decode\n")


def _store_a_in_bs_blob(metadata: Metadata) -> None:
    metadata.storage_data = {MetadataIndex("a", [0]): metadata.storage_data[
        MetadataIndex("b", [0])]}
    del metadata.state_dict_metadata["b"]


@pytest.mark.parametrize(("state", "edit", "message", "summary"), [
    ({"gadget": Gadget(), "w": torch.ones(2)}, None,
     r"item 'gadget' in .*/__0_0\.distcp: holds .*Gadget, which "
     r"asynctron does not unpickle", "1 of 2 items corrupt"),
    ({"a": torch.ones(4), "b": torch.ones(5)}, _store_a_in_bs_blob,
     r"item 'a' in .*/__0_0\.distcp: expected torch\.float32 \[4\], found torch\.float32 "
     r"\[5\]; ", "1 of 1 items corrupt"),
], ids=["forbidden class", "wrong shape"])
def test_verify_fails_where_a_load_fails(tmp_path: object, capsys: pytest.CaptureFixture[str],
                                         state: dict, edit: object, message: str,
                                         summary: str) -> None:
    _save_stock(f"{tmp_path}/dcp", state)
    if edit is not None:
        _rewrite_metadata(f"{tmp_path}/dcp", edit)
    with pytest.raises(CorruptCheckpointError, match=rf"^{message}"):
        uvloop.run(_load(f"{tmp_path}/dcp"))
    assert main(["verify", f"{tmp_path}/dcp"]) == 1
    captured = capsys.readouterr()
    assert re.search(rf"^asynctron verify: {message}", captured.err, re.MULTILINE), captured.err
    assert captured.out == f"checkpoint {tmp_path}/dcp: {summary}\n"


def _tensor_entry(size: list[int], chunks: list[ChunkStorageMetadata]) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)


def _chunk(offsets: list[int], sizes: list[int]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def _hostile_checkpoint(path: str, state_dict_metadata: dict, storage_data: dict,
                        planner_data: object = None) -> str:
    """A checkpoint directory holding a 1 MiB data file and `.metadata` pickled from these."""
    os.makedirs(path)
    with open(f"{path}/__0_0.distcp", "wb") as f:
        f.truncate(1 << 20)
    with open(f"{path}/.metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata, planner_data, storage_data), f)
    return path


def _refused(path: str, message: str) -> CorruptCheckpointError:
    """The refusal, with a message of bounded length (a hostile value's repr can be huge).
    How long refusing takes at the reader's cap is `asynctron bench hostile`'s to measure."""
    with pytest.raises(CorruptCheckpointError, match=message) as raised:
        read_dcp_manifest(path)
    assert len(str(raised.value)) < 400
    return raised.value


def test_a_chunk_list_shared_by_every_key_is_refused_before_it_is_walked(tmp_path: object) -> None:
    """2000 keys share one list of 100k chunks (a few MiB pickled): finding each key's chunk
    in it would take 2e8 steps."""
    shared = _tensor_entry([100_000], [_chunk([i], [1]) for i in range(100_000)])
    keys = [f"k{i}" for i in range(2000)]
    path = _hostile_checkpoint(f"{tmp_path}/dcp", dict.fromkeys(keys, shared), {
        MetadataIndex(key, [0]): _StorageInfo("__0_0.distcp", 0, 4) for key in keys})
    _refused(path, r"^metadata .*/\.metadata: field 'state_dict_metadata': expected "
                           r"at most \d+ chunks in all \(one per 32 bytes of the file\), found "
                           r"\d+ by key 'k\d+'; chunks are listed more than once \(lists "
                           r"shared between keys, or chunks repeated\); ")


def test_a_chunk_listed_twice_is_refused(tmp_path: object) -> None:
    entry = _tensor_entry([2], [_chunk([1], [1])] * 2 + [_chunk([0], [1])])
    path = _hostile_checkpoint(f"{tmp_path}/dcp", {"w": entry}, {
        MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 0, 4)})
    _refused(path, r"^metadata .*: item 'w': chunk at \[1\] listed twice; ")


def test_a_file_name_nesting_shared_lists_is_refused_with_a_short_message(
        tmp_path: object) -> None:
    """A relative_path of 40 levels of one shared list twice: its repr would be 2**40 long."""
    nested: list = []
    for _ in range(40):
        nested = [nested, nested]
    path = _hostile_checkpoint(f"{tmp_path}/dcp", {"w": _tensor_entry([1], [_chunk([0], [1])])},
                               {MetadataIndex("w", [0]): _StorageInfo(nested, 0, 1)})
    _refused(path, r"^metadata .*: item 'w' file <list of 2>: expected a file name "
                           r"inside the checkpoint")


def test_a_huge_integer_is_refused_as_corrupt(tmp_path: object) -> None:
    path = _hostile_checkpoint(f"{tmp_path}/dcp", {"w": _tensor_entry([1], [_chunk([0], [1])])},
                               {MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 1 << 20000,
                                                                      1)})
    _refused(path, r"^metadata .*: item 'w' bytes \[<int of 20001 bits>, \+1\): "
                           r"expected inside __0_0\.distcp \(1048576 bytes\)")


def test_a_tensor_of_too_many_dims_is_refused(tmp_path: object) -> None:
    dims = 100_000
    entry = _tensor_entry([1] * dims, [_chunk([0] * dims, [1] * dims)])
    path = _hostile_checkpoint(f"{tmp_path}/dcp", {"w": entry},
                               {MetadataIndex("w", [0] * dims): _StorageInfo("__0_0.distcp", 0,
                                                                             1)})
    _refused(path, r"^metadata .*: item 'w' size: expected a torch\.Size of at most 64 "
                           r"dims in \[0, 2\*\*63\), found 100000 dims; ")


class _Call:
    """Pickles as a call of `function` on `args` (how a hostile pickle calls a global)."""

    def __init__(self, function: object, *args: object) -> None:
        self._reduced = (function, args)

    def __reduce__(self) -> tuple:
        return self._reduced


class _HostileProperties:
    """Pickles as a `TensorProperties` made by NEWOBJ, then given `state` by BUILD."""

    __class__ = TensorProperties  # type: ignore[assignment]  # what the pickler names

    def __init__(self, state: tuple) -> None:
        self._state = state

    def __reduce__(self) -> tuple:
        return copyreg.__newobj__, (TensorProperties,), self._state


def _shared_nest(kind: type, depth: int = 40) -> object:
    nested = kind()
    for _ in range(depth):
        nested = kind([nested, nested])
    return nested


@pytest.mark.parametrize("call", [
    _Call(_MEM_FORMAT_ENCODING, list(range(100_000))),  # the enum's ValueError holds its repr
    _Call(torch.serialization._get_layout, tuple(range(100_000))),  # and the KeyError
    _HostileProperties(  # its __setstate__ formats the bad encoding into its error
        (torch.float32, torch.strided, False, list(range(100_000)), False)),
    _Call(pathlib.PosixPath, *["x" * 1000] * 100),
    _Call(collections.OrderedDict, [(i, i) for i in range(10)]),
], ids=["memory format", "layout", "tensor properties", "path", "ordered dict"])
def test_admitted_globals_check_their_arguments_first(tmp_path: object, call: object) -> None:
    path = _hostile_checkpoint(f"{tmp_path}/dcp", {}, {}, planner_data=call)
    _refused(path, r"^metadata .*: expected a pickled Metadata, found UnpicklingError: "
                   r"'?((memory format|layout|TensorProperties state|PosixPath of) <(list|tuple) "
                   r"of \d+>: expected |OrderedDict with arguments)")


@pytest.mark.parametrize("call", [
    _Call(_MEM_FORMAT_ENCODING, _shared_nest(list)),
    _Call(torch.serialization._get_layout, _shared_nest(tuple)),  # a KeyError would hash it
], ids=["memory format", "layout"])
def test_shared_nests_are_refused_before_unpickling(tmp_path: object, call: object) -> None:
    path = _hostile_checkpoint(f"{tmp_path}/dcp", {}, {}, planner_data=call)
    _refused(path, r"^metadata .*: byte \d+: unpickling would (allocate more than \d+ bytes|"
                   r"hash, compare or copy more than \d+ elements)")


@pytest.mark.parametrize("planner_data", [
    {"a": ("a",), "a.b": ("a", "b")},  # "a" is both a value and a dict
    {"a": tuple(["x"] * 5000), "a.b": ("a", "b")},  # nests deeper than Python recursion
], ids=["conflicting paths", "deep path"])
def test_bad_planner_data_falls_back_to_flat_keys(tmp_path: object, planner_data: dict) -> None:
    entry = _tensor_entry([1], [_chunk([0], [1])])
    path = _hostile_checkpoint(f"{tmp_path}/dcp", {"a": entry, "a.b": entry}, {
        MetadataIndex("a", [0]): _StorageInfo("__0_0.distcp", 0, 4),
        MetadataIndex("a.b", [0]): _StorageInfo("__0_0.distcp", 4, 4)}, planner_data)
    manifest = read_dcp_manifest(path)
    assert manifest.structure == {"dict": [["a", {"item": "a"}], ["a.b", {"item": "a.b"}]]}


async def _load(path: str) -> dict:
    async with Engine() as engine:
        return await engine.load(path)


def _rich_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {"w": torch.randn(8, 4, generator=g),
                  "big": torch.randn(1 << 16, 192, generator=g),  # 48 MiB: cut into 2 chunks
                  "h": torch.randn(3, generator=g).to(torch.bfloat16),
                  "flags": torch.tensor([True, False]), "z": torch.empty(0, 3),
                  "t": torch.randn(4, 6, generator=g).t()},
        "optim": {"state": {0: {"exp_avg": torch.randn(8, 4, generator=g), "step": 3}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "step": 7, "name": "run-1", "none": None, "blob": b"\x00\x01",
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
        "layers": [torch.ones(2), torch.zeros(2, 2)],
    }


def _template(state: dict) -> dict:
    """What a trainer hands stock `dcp.load`: the same structure with placeholder values."""
    if isinstance(state, dict):
        return {k: _template(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_template(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.full_like(state.contiguous(), 0) if state.numel() else state.clone()
    return state if isinstance(state, tuple) else None


@pytest.mark.parametrize("snapshot", [True, False])
async def test_format_dcp_is_read_by_stock_dcp_load(shm_path: str, snapshot: bool) -> None:
    """`format="dcp"`: stock `torch.distributed.checkpoint.load` fills a nested state dict with
    what asynctron saved (tensors of every kind, a tensor cut into chunks, pickled values),
    staged or written in place (frames from the plan, bodies from the caller's memory)."""
    state = _rich_state()
    async with Engine(num_bins=2) as engine:
        await engine.save(state, f"{shm_path}/d", format="dcp", snapshot=snapshot)
    target = _template(state)
    dcp.load(target, checkpoint_id=f"{shm_path}/d", no_dist=True)
    expected = dict(state, model=dict(state["model"], t=state["model"]["t"].contiguous()))
    expected["optim"] = {"state": {0: state["optim"]["state"][0]},
                         "param_groups": state["optim"]["param_groups"]}
    assert_same(expected["model"], target["model"])
    assert_same(expected["layers"], target["layers"])
    assert target["step"] == 7 and target["name"] == "run-1" and target["none"] is None
    assert target["blob"] == b"\x00\x01" and np.array_equal(target["arr"], state["arr"])
    assert target["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert torch.equal(target["optim"]["state"][0]["exp_avg"],
                       state["optim"]["state"][0]["exp_avg"])


async def test_format_dcp_reads_back_through_either_manifest(shm_path: str) -> None:
    """asynctron reads its DCP-format checkpoint raw, with checksums (`manifest.json`), or as
    any DCP checkpoint (`.metadata`)."""
    state = _rich_state()
    async with Engine(num_bins=2) as engine:
        await engine.save(state, f"{shm_path}/d", format="dcp")
        raw = await engine.load(f"{shm_path}/d")
        os.rename(f"{shm_path}/d/manifest.json", f"{shm_path}/manifest.json.away")
        through_dcp = await engine.load(f"{shm_path}/d")
    assert_same(state, raw)
    state["optim"]["state"] = {"0": state["optim"]["state"][0]}  # DCP keeps dict keys as str
    assert_same(state, through_dcp)


async def test_format_dcp_items_are_checksummed(shm_path: str) -> None:
    state = {"w": torch.arange(1000.0), "step": 3}
    async with Engine() as engine:
        await engine.save(state, f"{shm_path}/d", format="dcp")
        with open(f"{shm_path}/d/manifest.json") as f:
            w = next(item for item in json.load(f)["items"] if item["key"] == "w")
        with open(f"{shm_path}/d/{w['file']}", "r+b") as f:
            f.seek(w["offset"] + 7)
            byte = f.read(1)
            f.seek(w["offset"] + 7)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CorruptCheckpointError, match=r"^item 'w' in .*: expected xxh3_64 "):
            await engine.load(f"{shm_path}/d")


async def test_format_dcp_refuses_what_loading_could_not_read(shm_path: str) -> None:
    async with Engine() as engine:
        task = engine.save({"extra": (1, Gadget())}, f"{shm_path}/d", format="dcp")
        for milestone in (task.staged, task):
            with pytest.raises(TypeError, match=r"^value at key 'extra': expected tensors, "
                                                r"ndarrays, bytes, JSON values and containers of "
                                                r"them, found .*Gadget"):
                await milestone
        assert not os.listdir(shm_path)  # nothing written, not even a tmp dir
        with pytest.raises(ValueError, match=r"^format: expected 'asynctron' or 'dcp', found "
                                             r"'zip'$"):
            engine.save({"w": torch.ones(1)}, f"{shm_path}/d", format="zip")  # type: ignore[arg-type]


@pytest.fixture
def one_rank_group() -> object:
    """torch.distributed as rank 0 of 1 (gloo, in-process store), which Megatron needs."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_format_dcp_is_read_by_megatrons_torch_dist_loader(shm_path: str,
                                                           one_rank_group: object) -> None:
    strategies = pytest.importorskip("megatron.core.dist_checkpointing.strategies.torch",
                                     reason="megatron-core is not importable")
    from megatron.core.dist_checkpointing import ShardedTensor

    import asynctron

    weight, bias = torch.randn(64, 16), torch.randn(16)
    asynctron.save({"decoder.weight": weight, "decoder.bias": bias}, f"{shm_path}/m",
                   format="dcp")
    sharded = {key: ShardedTensor.from_rank_offsets(key, torch.zeros_like(value), replica_id=0)
               for key, value in (("decoder.weight", weight), ("decoder.bias", bias))}
    with warnings.catch_warnings():  # Megatron calls DCP's deprecated load_state_dict
        warnings.simplefilter("ignore", FutureWarning)
        loaded = strategies.TorchDistLoadShardedStrategy().load(sharded, f"{shm_path}/m")
    assert torch.equal(loaded["decoder.weight"], weight)
    assert torch.equal(loaded["decoder.bias"], bias)
