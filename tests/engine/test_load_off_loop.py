"""A load's work per item runs off the event loop: planning `load_into` and `load` (one step
per key) and cutting a file's reads into batches (one step per item) happen on the engine's
executor, so a 10,000-tensor load never holds the loop for the length of its plan."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from asynctron import Engine
from asynctron.engine import _load
from asynctron.storage.backends.local import _reader
from tests.conftest import assert_same


async def test_load_planning_and_read_batches_run_off_the_loop(
        shm_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: dict[str, set[int]] = {"plan": set(), "batches": set()}
    real_overlap, real_batches = _load.Loader._plan_overlap, _reader.plan_reads

    def plan_overlap(self: Any, *args: Any, **kwargs: Any) -> None:
        threads["plan"].add(threading.get_ident())
        real_overlap(self, *args, **kwargs)

    def plan_reads(*args: Any) -> Any:
        threads["batches"].add(threading.get_ident())
        return real_batches(*args)

    monkeypatch.setattr(_load.Loader, "_plan_overlap", plan_overlap)
    monkeypatch.setattr(_reader, "plan_reads", plan_reads)
    state = {f"t{i}": torch.randn(3, 4) for i in range(50)}
    state["strided"] = torch.randn(6, 5)
    async with Engine() as engine:
        await engine.save(state, f"{shm_path}/c")
        target = {key: torch.zeros_like(value) for key, value in state.items()}
        target["strided"] = torch.zeros(5, 6).t()
        await engine.load_into(target, f"{shm_path}/c")
        fresh = await engine.load(f"{shm_path}/c")
    assert_same(state, target)
    assert_same(state, fresh)
    loop_thread = threading.get_ident()
    assert threads["plan"] and loop_thread not in threads["plan"]
    assert threads["batches"] and loop_thread not in threads["batches"]
