"""Smoke test: the trainer benchmark runs every trainer and method at a tiny size and reports
blocking, total and retained work. Structure only, never speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_run_measures_every_trainer_and_method(shm_path: str, tmp_path: object) -> None:
    """In a process of its own: DCP's process mode needs a process group, which would outlive
    the test in this one."""
    out = f"{tmp_path}/train.json"
    subprocess.run([sys.executable, "-m", "asynctron.bench.train", "--quick", "--target", shm_path,
                    "--out", out, "--skip-megatron"], cwd=ROOT, check=True, timeout=600,
                   capture_output=True)
    with open(out) as f:
        results = json.load(f)
    methods = {"asynctron", "asynctron (workers at nice +0)", "dcp async_save (thread)",
               "dcp async_save (process)", "dcp async_save (thread, default stager)"}
    for kind in ("idle", "python", "torch", "gpt"):
        assert set(results[kind]) == methods
        for m in results[kind].values():
            assert 0 < m["blocking_s"] <= m["total_s"]
    assert all("retained" in m for m in results["python"].values())
    assert "blocking_vs_idle" in results["torch"]["asynctron"]
    assert all(m["step_saving_s"] > 0 and m["step_alone_s"] > 0
               for m in results["gpt"].values())
