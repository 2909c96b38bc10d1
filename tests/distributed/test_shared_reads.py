"""Collective loads that read each stored item once per job (`EngineConfig.share_reads`), on
three real gloo ranks: replicated state is read once between the ranks, spread over them, and
sent to the others; a resharding load reads each saved chunk once; what a rank received is
checked; a corrupt item or a rank whose reads fail makes every rank raise, none hangs.

Bytes read are counted by each rank's `FaultyBackend` (the local filesystem, counting).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import uvloop
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from asynctron import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    Engine,
    PeerError,
    StorageError,
)
from asynctron._launch import run_local_ranks
from asynctron.storage.format import parse_manifest
from asynctron.testing import FaultyBackend

pytestmark = pytest.mark.slow

WORLD = 3


def _replicated() -> dict[str, Any]:
    """A data-parallel state: every rank holds the same tensors (sizes unequal, so the
    readers' shares must balance), a bytes item and a JSON value."""
    return {"model": {f"layer{i}": torch.arange(i * 1000, i * 1000 + 4096 * (i + 1),
                                                dtype=torch.float32).reshape(-1, 64)
                      for i in range(7)},
            "blob": b"tokenizer state",
            "step": 12}


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "blob": b"", "step": 0}


def _equal(loaded: dict[str, Any], state: dict[str, Any]) -> bool:
    return (all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
            and loaded["blob"] == state["blob"] and loaded["step"] == state["step"])


def _data_bytes(path: str) -> tuple[int, int]:
    """The bytes of the checkpoint's items, and of its data files (which also hold the
    alignment padding between items: a read that joins neighbours reads it too)."""
    with open(os.path.join(path, "manifest.json"), "rb") as file:
        manifest = parse_manifest(file.read(), path)
    return sum(record.nbytes for record in manifest.items), sum(manifest.files.values())


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def shared_loads(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(48 * 30, dtype=torch.float32).reshape(48, 30)
    out: dict[str, Any] = {}

    async def run() -> None:
        backend = FaultyBackend()
        async with Engine(backend=backend, share_reads=True,
                          coordination_timeout_s=60) as engine:
            state = _replicated()
            await engine.save(state, f"{root}/dp")
            await engine.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, f"{root}/rows")

            def read_since(start: int) -> int:
                return backend.bytes_read - start

            start = backend.bytes_read
            loaded = await engine.load_into(_zeros_like(state), f"{root}/dp", collective=True)
            out["into_ok"] = _equal(loaded, state)
            out["into_read"] = read_since(start)

            start = backend.bytes_read
            out["fresh_ok"] = _equal(await engine.load(f"{root}/dp", collective=True), state)
            out["fresh_read"] = read_since(start)

            # Resharding: rows saved, columns loaded: every saved chunk is wanted in part by
            # every rank, so each is read whole once and sent.
            columns = distribute_tensor(torch.zeros(48, 30), mesh, [Shard(1)])
            start = backend.bytes_read
            await engine.load_into({"w": columns}, f"{root}/rows", collective=True)
            out["columns_ok"] = torch.equal(columns.full_tensor(), full)
            out["columns_read"] = read_since(start)

            # The layout that saved it: each rank's chunk is its own, read before the agreement.
            rows = distribute_tensor(torch.zeros(48, 30), mesh, [Shard(0)])
            start = backend.bytes_read
            await engine.load_into({"w": rows}, f"{root}/rows", collective=True)
            out["rows_ok"] = torch.equal(rows.full_tensor(), full)
            out["rows_read"] = read_since(start)

            # A stock DCP checkpoint (torch.save blobs) of the replicated model, read once.
            model = state["model"]
            await asyncio.to_thread(dcp.save, {"model": model},
                                    storage_writer=dcp.FileSystemWriter(f"{root}/stock"))
            target = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
            start = backend.bytes_read
            await engine.load_into(target, f"{root}/stock", collective=True)
            out["stock_ok"] = all(torch.equal(target["model"][k], v) for k, v in model.items())
            out["stock_read"] = read_since(start)

        async with Engine(backend=backend, share_reads=False,
                          coordination_timeout_s=60) as engine:
            start = backend.bytes_read
            await engine.load_into(_zeros_like(state), f"{root}/dp", collective=True)
            out["unshared_read"] = read_since(start)

        # A rank whose reads fail (every read EIO on rank 1): every rank raises, none hangs.
        failing = FaultyBackend(eio_on_read=rank == 1)
        async with Engine(backend=failing, share_reads=True,
                          coordination_timeout_s=60) as engine:
            try:
                await engine.load_into(_zeros_like(state), f"{root}/dp", collective=True)
                out["eio"] = None
            except (StorageError, PeerError) as error:
                out["eio"] = _failure(error)
            # The ranks' groups still work afterwards (the exchange ended on every rank).
            try:
                await engine.load(f"{root}/nothing", collective=True)
            except CheckpointNotFoundError:
                out["after_eio"] = True

    try:
        uvloop.run(run())
    finally:
        out["rank"] = rank
    return out


def corrupt_load(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def run() -> None:
        async with Engine(share_reads=True, coordination_timeout_s=60) as engine:
            try:
                await engine.load_into(_zeros_like(_replicated()), f"{root}/dp",
                                       collective=True)
                out["error"] = None
            except (CorruptCheckpointError, PeerError) as error:
                out["error"] = _failure(error)

    uvloop.run(run())
    return out


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("shared"))
    results = run_local_ranks(shared_loads, WORLD, root, timeout_s=240)
    return root, [result.unwrap() for result in results]


def test_replicated_state_is_read_once_between_the_ranks(
        loads: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = loads
    assert all(r["into_ok"] and r["fresh_ok"] for r in results)
    size, files = _data_bytes(f"{root}/dp")
    for kind in ("into_read", "fresh_read"):
        read = [r[kind] for r in results]
        assert size <= sum(read) <= files, (kind, read, size, files)
        assert all(part > 0 for part in read), (kind, read)  # spread, not all on rank 0
    unshared = sum(r["unshared_read"] for r in results)
    assert unshared >= WORLD * size  # each rank reads all (and the padding between items)


def test_a_stock_dcp_checkpoint_is_read_once_too(
        loads: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = loads
    assert all(r["stock_ok"] for r in results)
    blobs = sum(os.path.getsize(os.path.join(f"{root}/stock", name))
                for name in os.listdir(f"{root}/stock") if name.endswith(".distcp"))
    read = [r["stock_read"] for r in results]
    assert sum(read) <= blobs and all(part > 0 for part in read), (read, blobs)


def test_a_resharding_load_reads_each_saved_chunk_once(
        loads: tuple[str, list[dict[str, Any]]]) -> None:
    root, results = loads
    assert all(r["columns_ok"] and r["rows_ok"] for r in results)
    assert [r["rows_read"] for r in results] == [48 * 30 * 4 // WORLD] * WORLD  # its own
    size, files = _data_bytes(f"{root}/rows")
    assert size <= sum(r["columns_read"] for r in results) <= files


def test_a_rank_whose_reads_fail_fails_every_rank_and_none_hangs(
        loads: tuple[str, list[dict[str, Any]]]) -> None:
    _, results = loads
    errors = [r["eio"] for r in results]
    assert all(error is not None for error in errors), errors
    assert errors[1].startswith("StorageError")
    for rank in (0, 2):
        assert "rank 1" in errors[rank], errors[rank]
    assert all(r["after_eio"] for r in results)


def test_a_corrupt_item_fails_every_rank_naming_it(
        loads: tuple[str, list[dict[str, Any]]]) -> None:
    root, _ = loads
    path = f"{root}/dp"
    name = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    with open(os.path.join(path, name), "r+b") as file:
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 0xFF]))
    results = [r.unwrap() for r in run_local_ranks(corrupt_load, WORLD, root, timeout_s=120)]
    errors = [r["error"] for r in results]
    assert all(error is not None for error in errors), errors
    corrupt = [error for error in errors if error.startswith("CorruptCheckpointError")]
    assert corrupt, errors  # the reader, and every rank that received the item, names it
    assert all("model.layer" in error and name in error for error in corrupt), corrupt
