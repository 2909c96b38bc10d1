"""Targets filled through slabs (CUDA and strided ones; strided CPU targets here): many small
items packed into a slab, items larger than a slab in pieces, every byte in place, a damaged
item named whether it was packed or pieced, and every slab back in the pool afterwards."""

from __future__ import annotations

import os

import pytest
import torch

from asynctron import Engine
from asynctron.engine._slab_fill import SlabFill, SlabFiller, pack
from asynctron.errors import CorruptCheckpointError
from asynctron.storage.format._manifest import ItemRecord, parse_manifest
from tests.conftest import assert_same

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10, "num_bins": 2}


def _record(key: str, offset: int, nbytes: int) -> ItemRecord:
    return ItemRecord(key=key, file="f", offset=offset, nbytes=nbytes, kind="tensor",
                      dtype="float32", shape=(nbytes // 4,), checksum=None)


def test_small_items_share_a_slab_and_a_large_one_is_cut_in_whole_elements() -> None:
    target = torch.zeros(1)
    fills = [SlabFill(_record("a", 0, 100), target), SlabFill(_record("b", 100, 40), target),
             SlabFill(_record("c", 140, 1000), target), SlabFill(_record("d", 1140, 8), target)]
    batches = pack(fills, slab_bytes=256)
    assert [[(p.fill.record.key, p.start, p.nbytes, p.at) for p in batch]
            for batch in batches] == [
        [("a", 0, 100, 0), ("b", 0, 40, 128)],  # each piece 64-byte aligned in its slab
        [("c", 0, 256, 0)], [("c", 256, 256, 0)], [("c", 512, 256, 0)], [("c", 768, 232, 0)],
        [("d", 0, 8, 0)]]


def _strided_state(count: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    state = {f"small{i}": torch.randn(7, 5, generator=generator) for i in range(count)}
    state["large"] = torch.randn(300, 200, generator=generator)  # 240 KB: four slabs' worth
    state["bf16"] = torch.randn(33, 9, generator=generator).to(torch.bfloat16)
    return state


def _strided_targets(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.zeros(tuple(reversed(value.shape)), dtype=value.dtype).t()
            for key, value in state.items()}


async def test_many_strided_targets_are_filled_exactly(shm_path: str) -> None:
    state = _strided_state(300)
    async with Engine(**SMALL) as engine:
        await engine.save(state, f"{shm_path}/c")
        target = _strided_targets(state)
        await engine.load_into(target, f"{shm_path}/c")
        assert engine.budget.borrowed_bytes == 0
    assert all(not value.is_contiguous() for value in target.values())
    assert_same(state, target)


def _flip_last_byte_of(path: str, key: str) -> None:
    with open(f"{path}/manifest.json", "rb") as file:
        manifest = parse_manifest(file.read(), path)
    (record,) = [item for item in manifest.items if item.key == key]
    with open(os.path.join(path, record.file), "r+b") as file:
        file.seek(record.offset + record.nbytes - 1)
        last = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([last[0] ^ 0x40]))


@pytest.mark.parametrize("key", ["small7", "large"])
async def test_a_damaged_item_is_named_and_every_slab_returns(shm_path: str, key: str) -> None:
    """`small7` is read packed with others in one batch; `large` in pieces, its digest checked
    after the last one."""
    state = _strided_state(40)
    async with Engine(**SMALL) as engine:
        await engine.save(state, f"{shm_path}/c")
        _flip_last_byte_of(f"{shm_path}/c", key)
        with pytest.raises(CorruptCheckpointError, match=rf"{key}"):
            await engine.load_into(_strided_targets(state), f"{shm_path}/c")
        assert engine.budget.borrowed_bytes == 0


async def test_contiguous_targets_take_one_view_each_and_land_exactly(shm_path: str) -> None:
    """Contiguous targets (CUDA ones on a GPU; CPU ones here, handed to the filler directly):
    each whole item copied from one view of its slab; a large one in pieces."""
    state = _strided_state(120)
    async with Engine(**SMALL) as engine:
        await engine.save(state, f"{shm_path}/c")
        resources = engine._resources
        backend, checkpoint = resources.locate(f"{shm_path}/c")
        reader = await backend.open_reader(checkpoint, max_files_at_once=2)
        try:
            manifest = await reader.open()
            target = {key: torch.zeros_like(value) for key, value in state.items()}
            filler = SlabFiller(reader, pool=resources.pool,
                                copy_streams=resources.copy_streams,
                                run_blocking=engine.run_blocking, verify=True)
            await filler.fill([SlabFill(record, target[record.key])
                               for record in manifest.items])
        finally:
            await reader.aclose()
        assert engine.budget.borrowed_bytes == 0
    assert_same(state, target)
