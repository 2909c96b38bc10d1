"""A rank that never starts its engine: the others' `Engine.start` raises `PeerError` within
the coordination timeout and leaves nothing running."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import uvloop

from asynctron._launch import run_local_ranks
from asynctron.engine import Engine
from asynctron.errors import PeerError

pytestmark = pytest.mark.slow


def absent_rank(rank: int, world: int) -> dict[str, Any] | None:
    if rank == 1:  # alive, but never starts an engine
        time.sleep(4.0)
        return None

    async def run() -> dict[str, Any]:
        threads_before = threading.active_count()
        engine = Engine(coordination_timeout_s=2)
        started_s = time.perf_counter()
        with pytest.raises(PeerError) as raised:
            await engine.start()
        elapsed_s = time.perf_counter() - started_s
        deadline = time.monotonic() + 5.0
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.01)  # the executor's idle worker exits on its own
        return {"message": str(raised.value), "rank": raised.value.rank, "elapsed_s": elapsed_s,
                "timeout": isinstance(raised.value, TimeoutError),
                "threads_left": threading.active_count() - threads_before}

    return uvloop.run(run())


def test_an_absent_rank_fails_engine_start_and_leaves_nothing_running() -> None:
    results = run_local_ranks(absent_rank, 2, timeout_s=60, pg_timeout_s=2)
    assert results[1].unwrap() is None
    outcome = results[0].unwrap()
    assert outcome["message"].startswith(
        "engine start: expected every rank to start its Engine (creating the coordination "
        "groups), found a rank absent within 2 s (DistStoreError: ")
    assert outcome["rank"] is None and outcome["timeout"]  # a PeerTimeoutError
    assert outcome["elapsed_s"] < 10  # liveness, generous
    assert outcome["threads_left"] == 0
