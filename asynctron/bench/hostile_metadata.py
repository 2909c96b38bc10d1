"""Hostile checkpoint metadata: what reading a crafted `manifest.json` or DCP `.metadata` costs,
each in a fresh process, against a real checkpoint's metadata of the same size.

Every input is made at 16 MiB and at the reader's cap (`MAX_MANIFEST_BYTES`,
`MAX_METADATA_BYTES`), or at `--sizes-mib`: junk JSON in a field no manifest has (empty
lists, empty objects, floats, nesting, a long string, a huge integer, many keys), item lists
whose entries are cheap to write and costly to check, empty or nested lists in the known
fields (items, an item, the structure), and pickles that share one chunk list between every
key, repeat one memoised object, nest deeply, hold one huge integer, name memo index 2**31,
key a dict by a nest of shared tuples, make empty lists, or build one state into many
objects. Each is read the way a load reads it (`read_manifest` on a checkpoint directory).
Reported per input: refused (the error's first words) or loaded, wall time, the read's peak
memory, and both against the costliest real metadata of the same size (for `manifest.json`, a
checkpoint of tensors and one of empty lists). Target: at most 2 s and 1 GiB, or, where real
metadata itself takes more, at most 1.5 times what it takes.

Run: `asynctron bench hostile`; `--quick` for a smoke
run. Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from asynctron.bench import _results
from asynctron.storage import ItemRecord
from asynctron.storage.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    METADATA_NAME,
    encode_manifest,
)

MiB = 1 << 20
TIME_LIMIT_S = 2.0
MEMORY_LIMIT_BYTES = 1 << 30
#: a crafted input may cost this much more than the real metadata of its size
RELATIVE_LIMIT = 1.5
_FILE = "__0_0.distcp"

#: measured in a fresh process: read the checkpoint's metadata as a load does; the peak
#: resident set is reset after the imports (Linux's clear_refs), so it is the read's own
CHILD = """
import re, sys, time
from asynctron.storage.backends.local import read_manifest
def peak_bytes():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1)) << 10
def resident_bytes():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\\s+(\\d+) kB", f.read()).group(1)) << 10
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline = resident_bytes()
started = time.perf_counter()
try:
    manifest = read_manifest(sys.argv[1])
    outcome = f"loaded {len(manifest.items)} items"
except Exception as error:
    outcome = f"refused: {type(error).__name__}: {str(error)[:160]}"
elapsed = time.perf_counter() - started
print(repr((outcome, elapsed, peak_bytes() - baseline)))
"""


def _head(files: dict[str, int]) -> str:
    return json.dumps({"format": "asynctron", "version": 1, "created_unix_s": 1.0,
                       "checksum": None, "files": files})[:-1]


def _fill(prefix: str, unit: str, suffix: str, size: int) -> bytes:
    """`prefix` + `unit` repeated up to `size` bytes in all (comma-separated) + `suffix`."""
    count = max(1, (size - len(prefix) - len(suffix)) // (len(unit) + 1))
    return (prefix + ",".join([unit] * count) + suffix).encode()


def _records(count: int) -> list[ItemRecord]:
    return [ItemRecord(key=f"model.layers.{i}.mlp.weight", kind="tensor", file=_FILE,
                       offset=64 * i, nbytes=16, checksum=None, dtype="float32", shape=(4,),
                       global_shape=(4,), chunk_offsets=(0,)) for i in range(count)]


def legit_manifest(size: int) -> tuple[bytes, int]:
    """A real manifest (one 4-float tensor per item) of about `size` bytes, and the size of
    its data file."""
    per_item = len(encode_manifest(structure='{"dict":[]}', items=_records(1), checksums=None,
                                   files={_FILE: 64}, created_unix_s=1.0, checksum=None)) + 48
    items = _records(max(1, size // per_item))
    structure = json.dumps({"dict": [[r.key, {"item": r.key}] for r in items]},
                           separators=(",", ":"))
    return encode_manifest(structure=structure, items=items, checksums=None,
                           files={_FILE: 64 * len(items)}, created_unix_s=1.0,
                           checksum=None), 64 * len(items)


def legit_manifest_of_containers(size: int) -> tuple[bytes, int]:
    """A real manifest of about `size` bytes whose state dict holds empty lists (a manifest's
    densest legitimate content: a Python object every 20 bytes), and its data file's size."""
    empty = encode_manifest(structure='{"dict":[]}', items=[], checksums=None, files={},
                            created_unix_s=1.0, checksum=None)
    count = max(1, (size - len(empty)) // len('["k000000000",{"list":[]}],'))
    structure = json.dumps({"dict": [[f"k{i:09d}", {"list": []}] for i in range(count)]},
                           separators=(",", ":"))
    return encode_manifest(structure=structure, items=[], checksums=None, files={},
                           created_unix_s=1.0, checksum=None), 0


def manifest_attacks(size: int) -> dict[str, bytes]:
    files = {_FILE: 1 << 40}
    head = _head(files)
    room = size - len(head) - 64  # what an input has beside its head, within `size`
    item = ('{"key":"k","kind":"bytes","dtype":null,"shape":null,"global_shape":null,'
            '"chunk_offsets":null,"file":"__0_0.distcp","offset":0,"nbytes":0,"checksum":null}')
    return {
        "empty lists": _fill(head + ',"junk":[', "[]", '],"items":[],"structure":{"dict":[]}}',
                             size),
        "empty objects": _fill(head + ',"junk":[', "{}", "]}", size),
        "floats": _fill(head + ',"junk":[', "0.5", "]}", size),
        "nesting": (head + ',"junk":' + "[" * (room // 2) + "]" * (room // 2) + "}").encode(),
        "long string": (head + ',"junk":"' + "a" * room + '"}').encode(),
        "huge integer": (head + ',"junk":' + "9" * room + "}").encode(),
        "many keys": _fill(head + ',"junk":{', '"k":0', "}}", size),
        "one key listed many times": _fill(head + ',"items":[', item,
                                           '],"structure":{"dict":[]}}', size),
        "deep structure": (head + ',"items":[],"structure":' + '{"list":[' * (room // 11)
                           + "]}" * (room // 11) + "}").encode(),
        "items of empty lists": _fill(head + ',"items":[', "[]", '],"structure":{"dict":[]}}',
                                      size),
        "an item of nested lists": _fill(head + ',"items":[{"key":"k","kind":"tensor",'
                                         '"dtype":"float32","shape":[', "[]",
                                         ']}],"structure":{"dict":[]}}', size),
        "structure of empty lists": _fill(head + ',"items":[],"structure":{"list":[', "[]",
                                          "]}}", size),
    }


def _dcp_metadata(num_keys: int, chunks_per_key: int, shared: bool) -> Metadata:
    chunk_list = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1]))
                  for i in range(chunks_per_key)]
    properties = TensorProperties(dtype=torch.float32)
    sd_meta = {}
    storage = {}
    for k in range(num_keys):
        chunks = chunk_list if shared else [ChunkStorageMetadata(offsets=torch.Size([i]),
                                                                 sizes=torch.Size([1]))
                                            for i in range(chunks_per_key)]
        key = f"k{k:08d}"  # one width, so that 100 keys tell the size of a million
        sd_meta[key] = TensorStorageMetadata(properties, torch.Size([chunks_per_key]), chunks)
        for i in range(chunks_per_key):
            storage[MetadataIndex(key, torch.Size([i]), i)] = _StorageInfo(
                _FILE, 4 * len(storage), 4)
    return Metadata(state_dict_metadata=sd_meta, storage_data=storage)


def metadata_attacks(size: int) -> dict[str, bytes]:
    """Pickles built by pickling crafted objects (pickle shares what is shared), or by hand."""
    attacks = {}
    # One chunk list of many chunks shared by every key: small to write, key x chunk to check.
    chunks = max(1, size // 160)
    keys = max(1, size // (4 * 160))
    shared = _dcp_metadata(1, chunks, shared=True)
    entry = shared.state_dict_metadata["k00000000"]
    shared.state_dict_metadata.update({f"k{k:08d}": entry for k in range(1, keys)})
    shared.storage_data.update({MetadataIndex(f"k{k:08d}", torch.Size([0]), 0):
                                _StorageInfo(_FILE, 4 * (chunks + k), 4) for k in range(1, keys)})
    attacks["one chunk list shared by every key"] = pickle.dumps(shared, protocol=4)
    # One memoised object repeated: a list of `size/2` references (BINGET + APPENDS).
    one = pickle.dumps(["x"], protocol=4)
    body = one[:-2] + b"0(" + b"h\x01" * max(1, (size - len(one) - 4) // 2) + b"e."
    attacks["one object referenced many times"] = body
    attacks["deep nesting"] = b"\x80\x04" + b"]" * 2 + b"(" * (size // 2) + b"."
    digits = max(1, size - 16)
    attacks["huge integer"] = (b"\x80\x04\x8b" + digits.to_bytes(4, "little")
                               + b"\x01" * digits + b".")
    # PUT naming index 2**31 - 1: CPython grows its memo table to 32 GiB (10 bytes).
    attacks["memo index 2**31"] = b"\x80\x04]r\xff\xff\xff\x7f."
    # A dict keyed by a 60-level nest of shared tuples: hashing walks 2**60 tuples.
    nest = b")r\x00\x00\x00\x000"
    for i in range(60):
        get = b"j" + i.to_bytes(4, "little")
        nest += get + get + b"\x86r" + (i + 1).to_bytes(4, "little") + b"0"
    attacks["shared tuple nest as a dict key"] = (b"\x80\x04}" + nest + b"j"
                                                  + (60).to_bytes(4, "little") + b"K\x01s.")
    # Empty lists, a byte each, appended 1000 at a time as a pickler batches them: the objects
    # take 80 bytes a byte of pickle.
    batches = max(1, (size - 8) // 1002)
    attacks["empty lists"] = b"\x80\x04]" + b"(" + b"]" * 1000 + b"e" + (
        b"(" + b"]" * 1000 + b"e") * (batches - 1) + b"."
    # One state dict of 1000 fields, BUILT into DCP chunk objects of 15 bytes each (GET class,
    # EMPTY_TUPLE, NEWOBJ, GET state, BUILD, APPEND): 56 KB an object.
    state = b"}r\x01\x00\x00\x00(" + b"".join(
        b"\x8c\x06f" + f"{i:05d}".encode() + b"K\x01" for i in range(1000)) + b"u0"
    module, name = b"torch.distributed.checkpoint.metadata", b"ChunkStorageMetadata"
    head = (b"\x80\x04]\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name
            + b"\x93r\x00\x00\x00\x000" + state)
    objects = max(1, (size - len(head)) // 15)
    attacks["one state built into many objects"] = head + (
        b"j\x00\x00\x00\x00)\x81j\x01\x00\x00\x00ba" * objects) + b"."
    return attacks


def legit_metadata(size: int) -> tuple[bytes, int]:
    """A real DCP metadata (one 1-float tensor per key) of about `size` bytes, and the size
    of its data file."""
    per_key = len(pickle.dumps(_dcp_metadata(100, 1, shared=False), protocol=4)) / 100
    num_keys = max(1, int(size / per_key))
    while True:  # offsets grow wider with the count: shrink until it fits
        data = pickle.dumps(_dcp_metadata(num_keys, 1, shared=False),
                            protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) <= size or num_keys == 1:
            return data, 4 * num_keys
        num_keys = max(1, int(num_keys * size / len(data) * 0.999))


def _write_checkpoint(directory: str, name: str, data: bytes, data_bytes: int) -> str:
    """A checkpoint dir holding `data` as its metadata (`name`) and one data file."""
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
    with open(os.path.join(directory, _FILE), "wb") as f:
        f.truncate(data_bytes)
    return directory


def measure(checkpoint: str) -> tuple[str, float, int]:
    """(outcome, seconds, peak bytes above the baseline) of reading `checkpoint`'s metadata in
    a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, checkpoint], capture_output=True,
                         text=True, check=True).stdout
    return eval(out.strip().splitlines()[-1])  # our own child's repr of a tuple


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench hostile",
                                     description=_results.description(__doc__))
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=None,
                        help="input sizes (default: 16 MiB and each reader's cap)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="scratch directory")
    parser.add_argument("--quick", action="store_true",
                        help="1 MiB inputs, the real metadata and one attack per file (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    started = time.time()
    if args.quick:
        sizes: list[float | None] = [1.0]
    else:
        sizes = list(args.sizes_mib) if args.sizes_mib else [16.0, None]  # None: the cap

    # (metadata file, input, a builder of (its bytes, the size of the data file))
    cases: list[tuple[str, str, Callable[[], tuple[bytes, int]]]] = []
    attacks = 1 if args.quick else None
    for size_mib in sizes:
        manifest_size = int(size_mib * MiB) if size_mib else MAX_MANIFEST_BYTES
        metadata_size = int(size_mib * MiB) if size_mib else MAX_METADATA_BYTES
        cases.append(("manifest.json", "real manifest",
                      lambda n=manifest_size: legit_manifest(n)))
        cases.append(("manifest.json", "real manifest of empty lists",
                      lambda n=manifest_size: legit_manifest_of_containers(n)))
        for name in list(manifest_attacks(1024))[:attacks]:
            cases.append(("manifest.json", name,
                          lambda name=name, n=manifest_size: (manifest_attacks(n)[name], 1 << 40)))
        cases.append((".metadata", "real DCP metadata",
                      lambda n=metadata_size: legit_metadata(n)))
        for name in list(metadata_attacks(1024))[:attacks]:
            cases.append((".metadata", name,
                          lambda name=name, n=metadata_size: (metadata_attacks(n)[name], 1 << 40)))
    rows: list[dict[str, Any]] = []
    # per file, the costliest real metadata of the size at hand: (seconds, peak bytes)
    real: dict[str, tuple[float, int]] = {}
    print(f"{'file':14s} {'input':36s} {'MiB':>6s} {'s':>6s} {'peak MiB':>8s} {'x real':>11s}  "
          "outcome")
    for file, name, build in cases:
        directory = _results.scratch_dir("asynctron-hostile-", args.dir)
        try:
            data, data_bytes = build()
            checkpoint = _write_checkpoint(
                directory, MANIFEST_NAME if file == "manifest.json" else METADATA_NAME, data,
                data_bytes)
            outcome, seconds, peak = measure(checkpoint)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        row = {"file": file, "input": name, "bytes": len(data), "seconds": seconds,
               "peak_bytes": peak, "outcome": outcome}
        if name.startswith("real "):
            earlier = real.get(file) if rows and rows[-1]["input"].startswith("real ") else None
            real[file] = (max(seconds, earlier[0]), max(peak, earlier[1])) if earlier else (
                seconds, peak)
        real_seconds, real_peak = real[file]
        row["seconds_vs_real"] = seconds / real_seconds
        row["peak_vs_real"] = peak / max(real_peak, 1)
        row["within_absolute"] = seconds <= TIME_LIMIT_S and peak <= MEMORY_LIMIT_BYTES
        row["within_real"] = (seconds <= real_seconds * RELATIVE_LIMIT
                              and peak <= real_peak * RELATIVE_LIMIT)
        rows.append(row)
        print(f"{file:14s} {name:36s} {len(data) / MiB:6.1f} {seconds:6.2f} {peak / MiB:8.0f} "
              f"{row['seconds_vs_real']:5.2f} {row['peak_vs_real']:5.2f}  "
              f"{'' if row['within_absolute'] or row['within_real'] else 'OVER  '}"
              f"{outcome[:80]}")
    _results.write_results("hostile", {
        "meta": _results.run_meta(started, args, manifest_cap_bytes=MAX_MANIFEST_BYTES,
                                  metadata_cap_bytes=MAX_METADATA_BYTES,
                                  time_limit_s=TIME_LIMIT_S,
                                  memory_limit_bytes=MEMORY_LIMIT_BYTES,
                                  relative_limit=RELATIVE_LIMIT),
        "rows": rows}, out=args.out)
    return 0 if all(row["within_absolute"] or row["within_real"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
