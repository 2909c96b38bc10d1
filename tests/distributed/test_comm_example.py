"""The example async training loop (examples/async_train.py) runs on 2 spawned ranks at a
tiny size, learns, and ends with identical parameters on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "async_train.py")


@pytest.mark.slow
def test_async_training_example_runs_on_two_ranks(tmp_path: object) -> None:
    out = os.path.join(str(tmp_path), "result.json")
    completed = subprocess.run(
        [sys.executable, EXAMPLE, "--world-size", "2", "--steps", "40", "--samples", "4096",
         "--features", "16", "--hidden", "64", "--layers", "3", "--bucket-mb", "0.01",
         "--lr", "3e-3", "--json", out],
        capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(out) as f:
        result = json.load(f)
    assert result["identical_parameters"] is True
    assert result["num_steps"] == 40 and result["num_buckets"] >= 2
    assert result["last_loss"] < 0.5 * result["first_loss"]
    assert "parameters identical on every rank: True" in completed.stdout
