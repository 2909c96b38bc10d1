"""Fuzzing checkpoint metadata: any `manifest.json` (`parse_manifest`) and any DCP `.metadata`
(`read_dcp_manifest`) either is a valid `Manifest` or is refused with CorruptCheckpointError
naming the file; never another exception, and never tens of MiB for a few KiB.

Inputs: random bytes, and valid files mutated byte by byte (flips, cuts, insertions, spans
repeated) or value by value (a field, key or element replaced by a hostile value, deleted or
repeated, then encoded again). The valid files are saved by asynctron (both formats), by DCP's
own `dcp.save`, or built with the encoders (a tensor in a 2x2 grid of chunks). A manifest that
parses must encode and parse again to itself; a DCP one must keep its items inside its files.

Examples per test: see `conftest.py`. How long a hostile input at the reader's cap takes is
measured by `asynctron bench hostile`, not asserted here.

"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import event, given, reject
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import asynctron
from asynctron.errors import CorruptCheckpointError
from asynctron.storage.backends.local._reader import read_dcp_manifest
from asynctron.storage.format._dcp import METADATA_NAME, metadata_bytes
from asynctron.storage.format._dtypes import TORCH_DTYPES
from asynctron.storage.format._manifest import ItemRecord, encode_manifest, parse_manifest

#: what parsing an input of a few KiB may add to the peak RSS, whatever it holds
PEAK_RSS_INCREASE_LIMIT = 64 << 20


def _rich_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(8, 4, generator=g), "b": torch.arange(5),
                  "h": torch.randn(3, generator=g).to(torch.bfloat16), "z": torch.empty(0, 3),
                  "s": torch.tensor(2.5)},
        "optim": {"state": {0: {"exp_avg": torch.randn(8, 4, generator=g), "step": 3}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "step": 7, "name": "run-1", "none": None, "blob": b"\x00\x01",
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
        "layers": [torch.ones(2), torch.zeros(2, 2)],
    }


def _grid_records() -> list[ItemRecord]:
    """A float32 [4, 6] tensor in a 2x2 grid of chunks, and a bytes item, in one file."""
    corners = [(0, 0), (0, 3), (2, 0), (2, 3)]
    records = [ItemRecord(key="w", kind="tensor", file="__0_0.distcp", offset=4096 * (i + 1),
                          nbytes=24, checksum=None, dtype="float32", shape=(2, 3),
                          global_shape=(4, 6), chunk_offsets=corner)
               for i, corner in enumerate(corners)]
    return [*records, ItemRecord(key="b", kind="bytes", file="__0_0.distcp", offset=20_000,
                                 nbytes=5, checksum=None)]


class _Bases:
    """The valid inputs mutations start from: manifests (bytes) and DCP checkpoint dirs."""

    def __init__(self, root: str) -> None:
        asynctron.save(_rich_state(), f"{root}/asynctron")
        asynctron.save(_rich_state(), f"{root}/dcp_by_asynctron", format="dcp")
        dcp.save(_rich_state(), checkpoint_id=f"{root}/dcp", no_dist=True)
        grid = _grid_records()
        structure = json.dumps({"dict": [["w", {"item": "w"}], ["b", {"item": "b"}]]})
        self.manifests = [
            _read(f"{root}/asynctron/manifest.json"),
            _read(f"{root}/dcp_by_asynctron/manifest.json"),
            encode_manifest(structure=structure, items=grid, checksums=None,
                            files={"__0_0.distcp": 32768}, created_unix_s=1.0, checksum=None)]
        os.makedirs(f"{root}/grid")
        with open(f"{root}/grid/__0_0.distcp", "wb") as f:
            f.truncate(32768)
        with open(f"{root}/grid/{METADATA_NAME}", "wb") as f:
            f.write(metadata_bytes(grid[:4], [(100, 20)] * 4, {"w": ("w",)}, "grid"))
        self.checkpoints = [f"{root}/{name}" for name in ("dcp", "dcp_by_asynctron", "grid")]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def bases(workdir: str) -> _Bases:
    return _Bases(f"{workdir}/bases")


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    except OSError:
        return None
    return int(found.group(1)) << 10 if found else None


@contextlib.contextmanager
def _bounded_memory() -> Iterator[None]:
    """Assert the block, whether it returns or raises, raises the peak RSS by at most
    `PEAK_RSS_INCREASE_LIMIT` (where Linux lets /proc/self/clear_refs reset the peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _peak_rss_bytes()
    except OSError:
        before = None
    try:
        yield
    finally:
        after = _peak_rss_bytes()
        if before is not None and after is not None:
            assert after - before < PEAK_RSS_INCREASE_LIMIT, (
                f"peak RSS grew {after - before} bytes")


def _reason(message: str) -> str:
    """A refusal's kind for hypothesis' statistics: its message's first words, without
    values."""
    return "refused: " + " ".join(re.sub(r"'[^']*'|\[[^\]]*\]|\d+|<[^>]*>", "_",
                                          message.split(";")[0]).split()[:4])


# manifest.json -----------------------------------------------------------------------------

def _check_manifest(data: bytes) -> None:
    path = "fuzz/manifest.json"
    try:
        with _bounded_memory():
            manifest = parse_manifest(data, path)
    except CorruptCheckpointError as exc:
        assert exc.path == path and str(exc).startswith(f"manifest {path}: "), exc
        assert len(str(exc)) < 1000, f"a message of {len(str(exc))} characters"
        event(_reason(str(exc)[len(f"manifest {path}: "):]))
        return
    event("valid")
    encoded = manifest.to_json()
    assert parse_manifest(encoded, path).to_json() == encoded


HOSTILE_JSON = st.one_of(
    st.sampled_from([None, True, False, 0, 1, -1, 2**63 - 1, 2**63, 2**64, 10**30, 10**4000,
                     1.5, math.inf, -math.inf, math.nan, "", "x", "../../etc/passwd",
                     "__0_0.distcp", "__1_0.distcp", "float32", "bool", "tensor", "bytes",
                     "object", "ndarray", "torch_save", "raw", "xxh3_64", "0123456789abcdef",
                     "\x00", "é", "x" * 1000, [], {}, [0], [0, 0], [2**62, 2**62, 0],
                     [1] * 100, {"item": "w"}, {"value": 1}, {"dict": []}, {"list": [[]]},
                     [[]] * 50, {"key": "w"}]),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=4)
                 | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12),
)


def _slots(node: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) in a parsed JSON tree, parents before children."""
    found: list[tuple[Any, Any]] = []
    stack = [node]
    while stack:
        container = stack.pop()
        keys = list(container) if isinstance(container, dict) else range(len(container))
        for key in keys:
            found.append((container, key))
            if isinstance(container[key], dict | list):
                stack.append(container[key])
    return found


@st.composite
def json_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` (a manifest) with values replaced, deleted or repeated, encoded again (compact,
    spaced, or with raw non-ASCII)."""
    tree = json.loads(data)
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(tree)
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        kind = draw(st.sampled_from(["replace", "replace", "delete", "repeat"]))
        if kind == "replace":
            container[key] = copy.deepcopy(draw(HOSTILE_JSON))  # never the pool's own object
        elif kind == "delete":
            del container[key]
        elif isinstance(container, list):
            container.insert(key, json.loads(json.dumps(container[key])))
        else:
            container[draw(st.text(max_size=6))] = container[key]
    separators = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    raw_unicode = draw(st.integers(0, 7)) == 0  # refused at once: rarely, to reach the rest
    return json.dumps(tree, separators=separators,
                      ensure_ascii=not raw_unicode).encode("utf-8", "surrogatepass")


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with some of: bytes flipped, cut off, inserted, a span repeated or replaced."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "repeat", "replace"]))
        at = draw(st.integers(0, len(out)))
        if kind == "flip" and at < len(out):
            out[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del out[at:at + draw(st.integers(1, 64))]
        elif kind == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "repeat":
            span = out[at:at + draw(st.integers(1, 256))]
            out[at:at] = span * draw(st.integers(1, 8))
        elif kind == "replace":
            out[at:at + draw(st.integers(1, 16))] = draw(st.binary(max_size=16))
    return bytes(out)


@given(data=st.data())
def test_mutated_manifests(bases: _Bases, data: st.DataObject) -> None:
    manifest = data.draw(st.sampled_from(bases.manifests), label="base")
    if data.draw(st.booleans(), label="mutate values"):
        manifest = data.draw(json_mutations(manifest), label="values mutated")
    if data.draw(st.integers(0, 2), label="mutate bytes") == 0:
        manifest = data.draw(byte_mutations(manifest), label="bytes mutated")
    _check_manifest(manifest)


@given(data=st.one_of(st.binary(max_size=512), st.text(max_size=256).map(str.encode),
                      st.recursive(st.none() | st.integers() | st.text(max_size=4),
                                   lambda inner: st.lists(inner) | st.dictionaries(
                                       st.text(max_size=4), inner), max_leaves=20).map(
                                       lambda v: json.dumps(v).encode())))
def test_random_manifests(data: bytes) -> None:
    _check_manifest(data)


# DCP .metadata ------------------------------------------------------------------------------

def _check_metadata(workdir: str, base: str, data: bytes) -> None:
    checkpoint = tempfile.mkdtemp(dir=workdir)
    for name in os.listdir(base):
        if name not in (METADATA_NAME, "manifest.json"):
            os.link(f"{base}/{name}", f"{checkpoint}/{name}")
    with open(f"{checkpoint}/{METADATA_NAME}", "wb") as f:
        f.write(data)
    try:
        with _bounded_memory():
            manifest = read_dcp_manifest(checkpoint)
    except CorruptCheckpointError as exc:
        assert str(exc).startswith((f"metadata {checkpoint}/{METADATA_NAME}: ",
                                    f"file {checkpoint}/")), exc
        assert exc.path.startswith(f"{checkpoint}/"), exc.path
        assert len(str(exc)) < 1000, f"a message of {len(str(exc))} characters"
        event(_reason(str(exc).split(": ", 1)[1]))
        return
    finally:
        shutil.rmtree(checkpoint)
    event("valid")
    for item in manifest.items:
        assert item.offset + item.nbytes <= manifest.files[item.file]
        assert os.path.getsize(f"{base}/{item.file}") == manifest.files[item.file]
        if item.kind == "tensor":
            assert item.shape is not None and item.dtype is not None
            assert math.prod(item.shape) * TORCH_DTYPES[item.dtype].itemsize <= item.nbytes


def _hostile_values(draw: st.DrawFn) -> Any:
    nested: list = []
    for _ in range(draw(st.integers(0, 40))):
        nested = [nested, nested]
    size = st.lists(st.one_of(st.integers(0, 8), st.sampled_from([2**40, 2**62, 2**63 - 1])),
                    max_size=4).map(torch.Size)
    return draw(st.one_of(
        st.sampled_from([None, True, 0, -1, 2**63, 1 << 2000, 1.5, "", "x", "\x00",
                         "__0_0.distcp", ".metadata", "../outside", "x" * 300, (), [], {},
                         torch.float32, torch.int8, torch.complex64, torch.qint8, torch.strided,
                         torch.sparse_coo, BytesStorageMetadata(), TensorProperties(), nested,
                         tuple(nested), [nested] * 3]),
        size,
        st.builds(ChunkStorageMetadata, size, size),
        st.builds(MetadataIndex, st.sampled_from(["w", "model.w", "b"]), size,
                  st.integers(0, 3)),
        st.builds(_StorageInfo, st.sampled_from(["__0_0.distcp", "x"]), st.integers(-1, 5000),
                  st.integers(-1, 5000)),
        st.builds(lambda s, chunks: TensorStorageMetadata(TensorProperties(), s, chunks), size,
                  st.lists(st.builds(ChunkStorageMetadata, size, size), max_size=3)),
    ))


#: (container, how, name): a value of a dict or list (`"item"`), a dict's key (`"key"`), or an
#: object's attribute (`"attr"`).
_Slot = tuple[Any, str, Any]


def _object_slots(root: Any) -> list[_Slot]:
    """Every slot in an unpickled Metadata, each object visited once."""
    found: list[_Slot] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen or isinstance(node, str | int | float | torch.dtype | torch.Size):
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            children = [(node, "item", key) for key in node]
            found += [(node, "key", key) for key in node]
        elif isinstance(node, list):
            children = [(node, "item", i) for i in range(len(node))]
        elif hasattr(node, "__dict__"):
            children = [(node, "attr", name) for name in vars(node)]
        else:
            continue
        found += children
        stack += [getattr(node, name) if how == "attr" else node[name]
                  for node, how, name in children]
    return found


def _set(slot: _Slot, value: Any) -> None:
    container, how, name = slot
    if how == "attr":
        object.__setattr__(container, name, value)
    elif how == "key":
        with contextlib.suppress(TypeError):  # an unhashable new key
            container[value] = container.pop(name)
    else:
        container[name] = value


@st.composite
def object_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """A `.metadata` unpickled (it is the test's own), with fields, keys or elements replaced
    by hostile values (shared nests, huge ints, foreign objects), deleted or repeated, pickled
    again."""
    metadata = pickle.loads(data)
    for _ in range(draw(st.integers(1, 3))):
        slot = draw(st.sampled_from(_object_slots(metadata)))
        container, how, name = slot
        kind = draw(st.sampled_from(["replace", "replace", "delete", "repeat"]))
        if kind == "replace" or how == "attr":
            value = copy.deepcopy(_hostile_values(draw))  # never the pool's own object
            if isinstance(container, TensorProperties) and name == "memory_format" and (
                    not isinstance(value, torch.memory_format)):
                reject()  # its __getstate__ formats it into an error: a nest's repr is endless
            _set(slot, value)
        elif kind == "delete":
            del container[name]
        elif isinstance(container, list):
            container.extend([container[name]] * draw(st.integers(1, 1000)))
    try:  # TensorProperties.__getstate__ refuses a memory format it does not know
        return pickle.dumps(metadata, protocol=draw(st.sampled_from([2, 4, 5])))
    except RuntimeError:
        reject()


@given(data=st.data())
def test_mutated_metadata(workdir: str, bases: _Bases, data: st.DataObject) -> None:
    base = data.draw(st.sampled_from(bases.checkpoints), label="base")
    metadata = _read(f"{base}/{METADATA_NAME}")
    if data.draw(st.booleans(), label="mutate objects"):
        metadata = data.draw(object_mutations(metadata), label="objects mutated")
    if data.draw(st.integers(0, 2), label="mutate bytes") == 0:
        metadata = data.draw(byte_mutations(metadata), label="bytes mutated")
    _check_metadata(workdir, base, metadata)


@given(data=st.one_of(st.binary(max_size=512),
                      st.binary(max_size=512).map(lambda b: b"\x80\x04\x95" + b)))
def test_random_metadata(workdir: str, bases: _Bases, data: bytes) -> None:
    _check_metadata(workdir, bases.checkpoints[0], data)
