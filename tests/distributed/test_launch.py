"""`run_local_ranks` forks its ranks from a forkserver started once per caller: each rank
still takes the caller's environment and working directory as they are at the call, as a
spawned one would, and a rank that dies is reported, not waited for."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from asynctron._launch import run_local_ranks


def _environment_and_directory(rank: int, world_size: int, name: str) -> tuple[Any, ...]:
    import torch.distributed as dist

    return os.environ.get(name), os.getcwd(), dist.get_rank(), dist.get_world_size()


def _die_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@pytest.mark.slow
def test_ranks_take_the_callers_environment_and_directory_at_each_call(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "ASYNCTRON_TEST_LAUNCH"
    monkeypatch.setenv(name, "first")
    (only,) = run_local_ranks(_environment_and_directory, 1, name, timeout_s=120)
    assert only.unwrap() == ("first", os.getcwd(), 0, 1)
    monkeypatch.setenv(name, "second")
    monkeypatch.chdir(tmp_path)
    results = run_local_ranks(_environment_and_directory, 2, name, timeout_s=120)
    assert [result.unwrap() for result in results] == [
        ("second", str(tmp_path), rank, 2) for rank in range(2)]
    monkeypatch.delenv(name)
    (only,) = run_local_ranks(_environment_and_directory, 1, name, timeout_s=120)
    assert only.unwrap()[0] is None


@pytest.mark.slow
def test_a_killed_rank_is_reported_with_its_signal() -> None:
    first, second = run_local_ranks(_die_on_rank_one, 2, timeout_s=120, pg_timeout_s=30)
    assert first.unwrap() == 0
    assert second.failed and second.exitcode == -signal.SIGKILL
