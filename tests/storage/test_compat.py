"""Checkpoints written before the storage seam load, bit for bit, with today's code."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import asynctron
from asynctron.dcp import StorageReader

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "pre_seam"


def _expected() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(24, 16, generator=g),
                      "b": torch.arange(7, dtype=torch.int64),
                      "h": torch.randn(8, 8, generator=g).to(torch.bfloat16)},
            "optim": {"step": 3, "lr": 0.1, "names": ["a", "b"]},
            "blob": b"bytes\x00value", "arr": np.arange(12, dtype=np.float32).reshape(3, 4)}


def _assert_same(expected: Any, found: Any) -> None:
    if isinstance(expected, dict):
        assert expected.keys() == found.keys()
        for key in expected:
            _assert_same(expected[key], found[key])
    elif isinstance(expected, torch.Tensor):
        assert expected.dtype == found.dtype and torch.equal(expected, found)
    elif isinstance(expected, np.ndarray):
        assert expected.dtype == found.dtype and np.array_equal(expected, found)
    else:
        assert expected == found


@pytest.fixture
def fixtures(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy: a load takes locks in the checkpoint's directory, never writes its files."""
    return pathlib.Path(shutil.copytree(FIXTURES, tmp_path / "pre_seam"))


@pytest.mark.parametrize("kind", ["asynctron", "asynctron_dcp_format"])
async def test_an_engine_loads_what_the_engine_saved_before(fixtures: pathlib.Path,
                                                             kind: str) -> None:
    async with asynctron.Engine() as engine:
        _assert_same(_expected(), await engine.load(fixtures / kind))  # through `latest`
        lazy = await engine.load(fixtures / kind / "step_1", mmap=True)
    _assert_same(_expected()["model"], lazy["model"])


@pytest.mark.parametrize("kind", ["asynctron_dcp_format/step_1", "dcp_plugin"])
def test_stock_dcp_loads_through_the_plugin_what_was_saved_before(fixtures: pathlib.Path,
                                                                  kind: str) -> None:
    target = {"model": {key: torch.zeros_like(value)
                        for key, value in _expected()["model"].items()}}
    dcp.load(target, storage_reader=StorageReader(fixtures / kind))
    _assert_same(_expected()["model"], target["model"])
