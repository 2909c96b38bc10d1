"""`_pickle_costs.check`: what unpickling would cost, counted before anything is unpickled.

Its count must be an upper bound of what CPython's unpickler allocates (tracemalloc's peak),
and within a small factor of it for real DCP metadata, so that a budget a real checkpoint
meets bounds what a hostile one can make the unpickler do."""

from __future__ import annotations

import collections
import io
import pickle
import struct
import tracemalloc
import warnings
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from asynctron.storage._pickle_costs import check
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)

from asynctron import CorruptCheckpointError
from asynctron.storage.backends.local._reader import read_dcp_manifest
from asynctron.storage.format._dcp import (
    UNPICKLE_BYTES_PER_BYTE,
    UNPICKLE_WORK_PER_BYTE,
    decode_blob,
    metadata_bytes,
)
from asynctron.storage.format._manifest import ItemRecord

UNBOUNDED = 1 << 62
N = 2000


def _costs(data: bytes) -> tuple[int, int]:
    return check(data, UNBOUNDED, UNBOUNDED)


def _unpickled_peak_bytes(data: bytes) -> int:
    tracemalloc.start()
    try:
        pickle.loads(data)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class _Plain:
    def __init__(self, i: int) -> None:
        self.__dict__.update({f"a{j}": i + j for j in range(20)})


SHAPES = {
    "empty lists": lambda: [[] for _ in range(N)],
    "empty dicts": lambda: [{} for _ in range(N)],
    "dict items": lambda: {i + 1000: None for i in range(N)},
    "ordered dict items": lambda: collections.OrderedDict((i + 1000, None) for i in range(N)),
    "set items": lambda: {i + 1000 for i in range(N)},
    "frozenset items": lambda: frozenset(i + 1000 for i in range(N)),
    "torch.Size": lambda: [torch.Size([i + 1000, 2, 3]) for i in range(N)],
    "chunks": lambda: [ChunkStorageMetadata(torch.Size([i + 1000]), torch.Size([1]))
                       for i in range(N)],
    "storage infos": lambda: [_StorageInfo("__0_0.distcp", i + 1000, 4) for i in range(N)],
    "metadata indices": lambda: [MetadataIndex(f"k{i}", torch.Size([0]), 0) for i in range(N)],
    "tensor properties": lambda: [TensorProperties(dtype=torch.float32) for _ in range(N)],
    "ints": lambda: [i + 1000 for i in range(N)],
    "big ints": lambda: [10**40 + i for i in range(N)],
    "floats": lambda: [i + 0.5 for i in range(N)],
    "ascii strings": lambda: [f"{i:040d}" for i in range(N)],
    "latin-1 strings": lambda: [f"\xe9{i:040d}" for i in range(N)],
    "astral strings": lambda: [f"\U0001f600{i:040d}" for i in range(N)],
    "bytes": lambda: [b"x" * (i % 100) + str(i).encode() for i in range(N)],
    "tuples": lambda: [(i + 1000, None, 1, 2, 3) for i in range(N)],
    "nested lists": lambda: [[[i]] for i in range(N)],
    "objects of 20 attributes": lambda: [_Plain(1000 + i) for i in range(N)],
    "dicts of str keys": lambda: [{"a": i + 1000, "b": None, "c": 1} for i in range(N)],
}


@pytest.mark.parametrize("protocol", [2, 5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_count_bounds_what_unpickling_allocates(shape: str, protocol: int) -> None:
    data = pickle.dumps(SHAPES[shape](), protocol=protocol)
    memory, _ = _costs(data)
    # protocol 2 pickles a set as a call, set(list), which the count takes for a copy
    table_built_by_a_call = 9 if protocol == 2 and "set" in shape else 1
    assert table_built_by_a_call * memory >= _unpickled_peak_bytes(data)


def _dcp_metadata(tmp_path: object, state: dict) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it saves in one process
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    with open(f"{tmp_path}/.metadata", "rb") as f:
        return f.read()


def _sharded_metadata(num_tensors: int, chunks: int) -> bytes:
    """asynctron's own `.metadata` of tensors in `chunks` row chunks each (as N ranks save)."""
    records = [ItemRecord(key=f"model.layers.{t}.mlp.weight", kind="tensor",
                          file=f"__{c}_0.distcp", offset=4096 * t, nbytes=32, checksum=None,
                          dtype="float32", shape=(1, 8), global_shape=(chunks, 8),
                          chunk_offsets=(c, 0))
               for t in range(num_tensors) for c in range(chunks)]
    return metadata_bytes(records, [(0, 0)] * len(records), {}, "ckpt")


@pytest.mark.parametrize("kind", ["stock DCP", "sharded", "short keys, 16 dims"])
def test_real_metadata_is_within_the_budget_and_counted_near_its_cost(tmp_path: object,
                                                                       kind: str) -> None:
    if kind == "stock DCP":
        data = _dcp_metadata(tmp_path, {f"model.layers.{i}.self_attention.linear_qkv.weight":
                                        torch.zeros(4, 4) for i in range(N)} | {"step": 3})
    elif kind == "sharded":
        data = _sharded_metadata(N // 8, 8)
    else:  # the densest real metadata found: a key of a few bytes, a Size of 16 dims
        data = _dcp_metadata(tmp_path, {f"{i}": torch.zeros((1,) * 16) for i in range(N)})
    memory, work = _costs(data)
    assert memory <= 0.75 * UNPICKLE_BYTES_PER_BYTE * len(data)
    assert work <= 0.5 * UNPICKLE_WORK_PER_BYTE * len(data)
    assert memory <= 3 * _unpickled_peak_bytes(data)


def _get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def _put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def _shared_tuple_nest(depth: int) -> bytes:
    """Opcodes pushing t[depth], where t[0] = () and t[i+1] = (t[i], t[i]): 10 bytes a level;
    hashing it walks 2**depth tuples (CPython does not cache a tuple's hash)."""
    ops = b")" + _put(0) + b"0"
    for i in range(depth):
        ops += _get(i) + _get(i) + b"\x86" + _put(i + 1) + b"0"
    return ops + _get(depth)


def test_a_shared_tuple_nest_as_a_dict_key_is_refused_by_its_hashing() -> None:
    shallow = b"\x80\x04}" + _shared_tuple_nest(8) + b"K\x01s."
    assert pickle.loads(shallow)  # what is counted is what runs
    assert _costs(shallow)[1] >= 2 * 2**8
    with pytest.raises(ValueError, match=r"^byte \d+: unpickling would hash, compare or copy "
                                         r"more than 1000000 elements \(a nest of shared "):
        check(b"\x80\x04}" + _shared_tuple_nest(60) + b"K\x01s.", UNBOUNDED, 1_000_000)


def test_a_put_beyond_the_memo_writes_before_it_is_refused() -> None:
    bomb = b"\x80\x04]" + _put(2**31 - 1) + b"."  # CPython would grow its memo to 32 GiB
    with pytest.raises(ValueError, match=r"^byte 3: memo index 2147483647 after 0 memo writes"):
        _costs(bomb)
    assert _costs(b"\x80\x04]" + _put(0) + b"0" + _get(0) + b".")  # what a pickler writes


def test_one_state_built_into_many_objects_is_counted_each_time() -> None:
    shared_state = {f"field{i}": i for i in range(1000)}
    objects = []
    for i in range(1000):
        obj = _Plain(i)
        obj.__dict__ = shared_state  # pickled once, BUILT 1000 times
        objects.append(obj)
    data = pickle.dumps(objects, protocol=4)
    memory, _ = _costs(data)
    assert memory >= 1000 * 1000 * 56
    assert memory > 100 * len(data)


def test_changing_an_object_after_placing_it_in_another_is_refused() -> None:
    # l = []; t = (l,); l.append(1): a pickler finishes l before it refers to it
    data = b"\x80\x04]" + _put(0) + _get(0) + b"\x85" + _put(1) + b"0" + _get(0) + b"K\x01a."
    with pytest.raises(ValueError, match=r"^byte \d+: APPEND changes an object already "
                                         r"placed in another"):
        _costs(data)


@pytest.mark.parametrize(("data", "message"), [
    (b"", r"^byte 0: the pickle ends without STOP$"),
    (b"\x80\x04N", r"^byte 3: the pickle ends without STOP$"),
    (b"\x80\x04.", r"^byte 2: STOP with nothing on the stack$"),
    (b"\x80\x04\x8c\x05ab.", r"^byte 2: a length of 5 bytes past the end$"),
    (b"\x80\x04\x8b\xff\xff\xff\xff.", r"^byte 2: a negative length$"),
    (b"\x80\x04X\xff\xff\xff\xff.", r"^byte 2: a length of 4294967295 bytes past the end$"),
    (b"\x80\x04t.", r"^byte 2: TUPLE, LIST, DICT or FROZENSET without a MARK$"),
    (b"\x80\x04(a.", r"^byte 3: APPEND needs 2 values on the stack$"),
    (b"\x80\x04}(K\x01u.", r"^byte 6: SETITEMS of an odd number of values$"),
    (b"\x80\x04h\x05.", r"^byte 2: memo index 5 was never written$"),
    (b"\x80\x04I1", r"^byte 2: a line argument without its newline$"),
    (b"\x80\x04\x82\x01.", r"^byte 2: an extension code$"),
    (b"\x80\x05\x97.", r"^byte 2: an out-of-band buffer$"),
    (b"\x80\x04\xff.", r"^byte 2: opcode 0xff, which no pickle protocol has$"),
], ids=["empty", "no stop", "stop on nothing", "short string", "negative length", "long length",
        "tuple without mark", "append underflow", "odd setitems", "unwritten memo", "no newline",
        "extension", "buffer", "unknown opcode"])
def test_malformed_pickles_are_refused_naming_the_byte(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _costs(data)


def test_a_dcp_metadata_memo_bomb_is_refused_before_unpickling(tmp_path: object) -> None:
    _dcp_metadata(tmp_path, {"w": torch.ones(2)})
    with open(f"{tmp_path}/.metadata", "wb") as f:
        f.write(b"\x80\x04]" + _put(2**31 - 1) + b".")
    with pytest.raises(CorruptCheckpointError, match=r"^metadata .*/\.metadata: byte 3: memo "
                                                     r"index 2147483647 after 0 memo writes"):
        read_dcp_manifest(str(tmp_path))


def test_a_torch_save_blob_is_counted_before_torch_load_unpickles_it() -> None:
    """A DCP item's blob whose pickle hashes a shared tuple nest (torch.load's own unpickler
    would hash it forever)."""
    buffer = io.BytesIO()
    torch.save({"a": 1}, buffer)
    hostile = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as source, \
            zipfile.ZipFile(hostile, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("/data.pkl"):
                data = b"\x80\x02}" + _shared_tuple_nest(60) + b"K\x01s."
            target.writestr(info, data)
    with pytest.raises(CorruptCheckpointError, match=r"^item 'x' in f: expected a torch\.save "
                                                     r"blob .*ValueError: byte \d+: unpickling "
                                                     r"would hash"):
        decode_blob(memoryview(hostile.getvalue()), key="x", path="f")
