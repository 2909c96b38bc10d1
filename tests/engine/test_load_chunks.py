"""Loading items stored as several chunks (what DCP shards become): assembled into one tensor."""

from __future__ import annotations

import os

import torch

from asynctron import Engine
from asynctron.storage import ItemRecord, Manifest
from asynctron.storage.format._checksum import XXH3_64, digest


def _write_chunked_checkpoint(path: str, full: torch.Tensor) -> None:
    """A checkpoint whose item 'w' is stored as its top and bottom halves, in one file."""
    os.mkdir(path)
    top, bottom = full[:2].contiguous(), full[2:].contiguous()
    data = bytearray(8192)
    records = []
    for offset, rows, part in ((0, 0, top), (4096, 2, bottom)):
        raw = part.numpy().tobytes()
        data[offset:offset + len(raw)] = raw
        records.append(ItemRecord(key="w", kind="tensor", file="__0_0.distcp", offset=offset,
                                  nbytes=len(raw), checksum=digest(memoryview(raw)),
                                  dtype="float32", shape=tuple(part.shape),
                                  global_shape=tuple(full.shape), chunk_offsets=(rows, 0)))
    with open(f"{path}/__0_0.distcp", "wb") as f:
        f.write(data)
    manifest = Manifest(structure={"dict": [["w", {"item": "w"}]]}, items=tuple(records),
                        files={"__0_0.distcp": len(data)}, created_unix_s=0.0,
                        checksum=XXH3_64)
    with open(f"{path}/manifest.json", "wb") as f:
        f.write(manifest.to_json())


async def test_chunks_are_assembled_fresh_and_in_place(shm_path: str) -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    _write_chunked_checkpoint(f"{shm_path}/c", full)
    async with Engine(slab_bytes=4096, memory_budget_bytes=8192) as engine:
        loaded = await engine.load(f"{shm_path}/c")
        target = {"w": torch.zeros(6, 4).t()}  # a strided target
        await engine.load_into(target, f"{shm_path}/c")
        contiguous = {"w": torch.zeros(4, 6)}
        await engine.load_into(contiguous, f"{shm_path}/c")
    assert torch.equal(loaded["w"], full)
    assert torch.equal(target["w"], full) and torch.equal(contiguous["w"], full)
