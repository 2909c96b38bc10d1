"""Smoke test: `asynctron bench gcs` starts its own fake-gcs-server, runs every method once at a
tiny size (each round-trips its state: the run fails otherwise; `raw parts + compose` composes
its parts), prints the ratios and the target, writes its JSON report and leaves no scratch
directory behind. Structure only, never speed. It runs in a fresh process, as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from asynctron.bench import gcs
from tests.conftest import skip_without_fake_gcs


@pytest.mark.slow
def test_quick_run_round_trips_every_method_and_writes_a_complete_report(
        tmp_path: object) -> None:
    skip_without_fake_gcs()
    out = f"{tmp_path}/gcs.json"
    run = subprocess.run([sys.executable, "-m", "asynctron", "bench", "gcs", "--quick",
                          "--dir", str(tmp_path), "--out", out],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(out) as f:
        results = json.load(f)
    # gcsfs is the bench extra's; without it the peer is named as skipped, with the reason
    expected_skipped = set() if importlib.util.find_spec("gcsfs") else {gcs.FSSPEC}
    assert set(results["skipped"]) == expected_skipped
    assert set(results["methods"]) == set(gcs.METHODS) - expected_skipped
    assert results["nbytes"] > 0 and results["world_size"] == 1
    for name, method in results["methods"].items():
        (run_result,) = method["rounds"]
        assert all(rank["verified"] for rank in run_result["ranks"]), name
        assert method["save_gb_per_s"] > 0 and method["load_gb_per_s"] > 0, name
        assert 0 < method["blocking_median_s"] <= method["save_median_s"], name
        assert method["save_cpu_s_per_gb"] > 0 and method["load_cpu_s_per_gb"] > 0, name
        assert method["server_cpu_s_per_gb"] > 0, name
        assert method["loop_worst_delay_median_s"] >= 0, name
    # --quick: 1 MiB ranges and parts, several of them in flight together
    for name in (gcs.RAW, gcs.RAW_COMPOSE):
        assert results["methods"][name]["most_in_flight"] >= 2, name
    assert results["methods"][gcs.OURS]["most_in_flight"] >= 1
    assert set(results["ratios"]["asynctron_over_raw_compose"]) == {"save", "load"}
    assert set(results["targets"]) == {"asynctron / raw, save", "asynctron / raw, load"}
    assert "asynctron_over_raw" in results["ratios"]
    printed = run.stdout
    assert "asynctron / raw, save:" in printed and "(target >= 0.9:" in printed
    if not expected_skipped:
        assert results["ratios"]["asynctron_over_fastest_peer"]["load"]["peer"] == gcs.FSSPEC
        assert "asynctron / peer, load:" in printed
    assert [name for name in os.listdir(str(tmp_path)) if name.startswith("asynctron-bench")
            ] == []  # its scratch directory (and the server's log) is gone
