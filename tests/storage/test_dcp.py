"""Stock torch.distributed.checkpoint checkpoints: asynctron reads them, never unpickling
anything but DCP's metadata types and plain values."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from asynctron import CorruptCheckpointError, Engine
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
        result = await engine.load(f"{tmp_path}/dcp", into=target)
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


async def test_an_item_holding_a_foreign_class_is_refused_by_name(tmp_path: object) -> None:
    _save_stock(f"{tmp_path}/dcp", {"gadget": Gadget(), "w": torch.ones(2)})
    with pytest.raises(CorruptCheckpointError,
                       match=r"^item 'gadget' in .*__0_0\.distcp: expected a torch\.save blob of "
                             r"tensors and plain values, found UnpicklingError"):
        await _load(f"{tmp_path}/dcp")


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


@pytest.mark.parametrize("target", [".metadata", "__0_0.distcp"])
async def test_a_linked_file_is_refused_not_followed(tmp_path: object, target: str) -> None:
    _save_stock(f"{tmp_path}/dcp", {"w": torch.ones(4)})
    os.rename(f"{tmp_path}/dcp/{target}", f"{tmp_path}/outside")
    os.symlink(f"{tmp_path}/outside", f"{tmp_path}/dcp/{target}")
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^file {tmp_path}/dcp/{target}: expected a regular file, found a "
                             r"symbolic link; "):
        await _load(f"{tmp_path}/dcp")


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
