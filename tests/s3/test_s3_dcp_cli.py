"""`format="dcp"`, the DCP plugins under stock `dcp.save`/`dcp.load`, and the CLI, on s3://."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import asynctron
from asynctron.dcp import StorageReader, StorageWriter
from tests.conftest import assert_same
from tests.s3.conftest import keys_under


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"w": torch.randn(1 << 20), "b": torch.randn(100), "step": torch.tensor(5)}


def test_stock_dcp_save_async_save_and_load_through_the_plugins(s3_root: str,
                                                                 s3_objects: Any) -> None:
    state = _state()
    dcp.save(state, storage_writer=StorageWriter(f"{s3_root}/dcp"))
    dcp.async_save(state, storage_writer=StorageWriter(f"{s3_root}/dcp_async")).result()
    target = {key: torch.empty_like(value) for key, value in state.items()}
    dcp.load(target, storage_reader=StorageReader(f"{s3_root}/dcp_async"))
    assert_same(state, target)
    target = {key: torch.empty_like(value) for key, value in state.items()}
    dcp.load(target, storage_reader=StorageReader(f"{s3_root}/dcp"))
    assert_same(state, target)
    names = keys_under(s3_objects, s3_root)
    assert "dcp/.metadata" in names and "dcp/manifest.json" in names
    assert not [name for name in names if name.startswith(".")]  # no claim left


def test_format_dcp_and_the_cli(s3_root: str) -> None:
    state = _state()
    asynctron.save(state, f"{s3_root}/fmt", format="dcp")
    assert_same(state, asynctron.load(f"{s3_root}/fmt"))
    for command, says in (("inspect", "w"), ("verify", "3 items, 4.0 MiB in 2 files: xxh3_64 ok")):
        done = subprocess.run([sys.executable, "-m", "asynctron", command, f"{s3_root}/fmt"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert says in done.stdout


def test_inspect_names_the_checkpoint_latest_named_and_its_values(s3_root: str) -> None:
    asynctron.save({**_state(), "step": 7, "sched": {"lr": 0.5}}, f"{s3_root}/step_7")
    done = subprocess.run([sys.executable, "-m", "asynctron", "inspect", s3_root],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"checkpoint {s3_root}/step_7 (named by {s3_root}'s latest)\n")
    assert re.search(r"^values:\n  step      7\n  sched\.lr  0\.5$", done.stdout, re.MULTILINE)
