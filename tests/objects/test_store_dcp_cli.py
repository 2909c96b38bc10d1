"""`format="dcp"`, the DCP plugins under stock `dcp.save`/`dcp.load`, and the CLI, on each
object store."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asynctron
from asynctron.dcp import StorageReader, StorageWriter
from tests.conftest import assert_same
from tests.objects.conftest import Store


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"w": torch.randn(1 << 20), "b": torch.randn(100), "step": torch.tensor(5)}


def test_stock_dcp_save_async_save_and_load_through_the_plugins(store: Store) -> None:
    state = _state()
    dcp.save(state, storage_writer=StorageWriter(f"{store.root}/dcp"))
    dcp.async_save(state, storage_writer=StorageWriter(f"{store.root}/dcp_async")).result()
    target = {key: torch.empty_like(value) for key, value in state.items()}
    dcp.load(target, storage_reader=StorageReader(f"{store.root}/dcp_async"))
    assert_same(state, target)
    target = {key: torch.empty_like(value) for key, value in state.items()}
    dcp.load(target, storage_reader=StorageReader(f"{store.root}/dcp"))
    assert_same(state, target)
    names = store.keys_under(store.root)
    assert "dcp/.metadata" in names and "dcp/manifest.json" in names
    assert not [name for name in names if name.startswith(".")]  # no claim left


def test_format_dcp_and_the_cli(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    from asynctron.cli import main

    state = _state()
    asynctron.save(state, f"{store.root}/fmt", format="dcp")
    assert_same(state, asynctron.load(f"{store.root}/fmt"))
    for command, says in (("inspect", "w"), ("verify", "3 items, 4.0 MiB in 2 files: xxh3_64 ok")):
        assert main([command, f"{store.root}/fmt"]) == 0
        assert says in capsys.readouterr().out


def test_inspect_names_the_checkpoint_latest_named_and_its_values(store: Store) -> None:
    asynctron.save({**_state(), "step": 7, "sched": {"lr": 0.5}}, f"{store.root}/step_7")
    done = subprocess.run([sys.executable, "-m", "asynctron", "inspect", store.root],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    named = f"checkpoint {store.root}/step_7 (named by {store.root}'s latest)\n"
    assert done.stdout.startswith(named)
    assert re.search(r"^values:\n  step      7\n  sched\.lr  0\.5$", done.stdout, re.MULTILINE)
