"""Launched by torchrun: the checkpoint example saves and reloads across 2 ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asynctron.testing._server_process import free_port

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "checkpoint_ranks.py")


@pytest.mark.slow
def test_checkpoint_example_under_torchrun(tmp_path: object) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), EXAMPLE,
         str(tmp_path)],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank}: wrote ('__{rank}_" in done.stdout
        assert "reloaded resharded: ok" in done.stdout
    assert os.path.exists(f"{tmp_path}/step_100/manifest.json")
