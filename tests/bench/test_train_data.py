"""Smoke test: the data-in-a-busy-trainer benchmark runs each method beside an idle and a
busy trainer at a tiny size and reports rates, waits and retained work. Structure only, never
speed. (The GIL-busy trainer is left out: megatron's imports alone take ~20 s beside it.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: every kind of method once (the 4-worker DataLoader runs the 2-worker's code)
METHODS = ("asynctron AsyncLoader", "DataLoader (2 workers)", "megatron ds[i]")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_run_measures_every_method(tmp_path: object) -> None:
    out = f"{tmp_path}/train_data.json"
    subprocess.run([sys.executable, "-m", "asynctron.bench.train_data", "--quick",
                    "--dir", str(tmp_path),
                    "--trainers", "idle,torch", "--caches", "cold", "--duration", "0.5",
                    "--methods", ",".join(METHODS),
                    "--out", out], cwd=ROOT, check=True, timeout=600, capture_output=True)
    with open(out) as f:
        medians = json.load(f)["medians"]["cold"]
    methods = set(METHODS)
    for trainer in ("idle", "torch"):
        assert set(medians[trainer]) == methods
        for row in medians[trainer].values():
            assert row["samples_per_s"] > 0 and row["first_batch_s"] > 0
            assert 0 <= row["wait_p50_s"] <= row["wait_p95_s"] <= row["wait_max_s"]
            assert ("retained" in row) == (trainer == "torch")
        assert medians[trainer]["asynctron AsyncLoader"]["over_best_peer"] > 0
    assert "loop_worst_delay_s" in medians["idle"]["asynctron AsyncLoader"]
