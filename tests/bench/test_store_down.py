"""Smoke test: `asynctron bench s3_down` stalls and kills its own store in the middle of a save,
a load and a dataset read, each fails, and the report says how long each took and what was
left. Structure (and the checks the run makes itself) only, never speed. It runs in a fresh
process, as a user runs it: the store's deadline and endpoint come from the environment, which a
process reads once, at its first s3:// URL (this worker's other tests made theirs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asynctron.bench import store_down
from tests.conftest import skip_without_seaweedfs


@pytest.mark.slow
def test_quick_run_fails_every_operation_and_keeps_the_previous_checkpoint(
        tmp_path: object) -> None:
    skip_without_seaweedfs()
    out = f"{tmp_path}/s3_down.json"
    run = subprocess.run([sys.executable, "-m", "asynctron.bench.store_down", "--quick",
                          "--dir", str(tmp_path), "--out", out],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode in (0, 1), run.stderr
    with open(out) as f:
        results = json.load(f)
    assert set(results["faults"]) == set(store_down.FAULTS)
    for fault in results["faults"].values():
        for operation in store_down.OPERATIONS:
            assert fault[operation]["failed_after_s"] > 0 and fault[operation]["error"]
        assert fault["previous intact"] and not fault["step_1 committed"]
        assert fault["saves again"] and fault["dataset still right"]
    assert run.returncode == (0 if results["met"] else 1)
    assert "every failure within deadline_s + 10%" in run.stdout
