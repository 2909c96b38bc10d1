"""Smoke test: `asynctron bench azure` and `asynctron bench gcs` each start their own server,
run every method once at a tiny size, `--only` naming them all (each round-trips its state:
the run fails otherwise; GCS's `raw parts + compose` composes its parts, its `raw resumable
(in order)` sends its chunks one after another, and asynctron's ratios over both are given),
print the ratios and the target, write their JSON report and leave no scratch directory
behind. Structure only, never speed. Each runs in a fresh process, as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import ModuleType

import pytest

from asynctron.bench import azure, gcs
from tests.conftest import skip_without_azurite, skip_without_fake_gcs

STORES = {"azure": (azure, skip_without_azurite, "adlfs"),
          "gcs": (gcs, skip_without_fake_gcs, "gcsfs")}


@pytest.mark.slow
@pytest.mark.parametrize("store", sorted(STORES))
def test_quick_run_round_trips_every_method_and_writes_a_complete_report(
        store: str, tmp_path: object) -> None:
    bench, skip_without_server, peer_module = STORES[store]
    assert isinstance(bench, ModuleType)
    skip_without_server()
    out = f"{tmp_path}/{store}.json"
    run = subprocess.run([sys.executable, "-m", "asynctron", "bench", store, "--quick",
                          "--only", ",".join(bench.METHODS), "--dir", str(tmp_path),
                          "--out", out],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(out) as f:
        results = json.load(f)
    # the peer is the bench extra's; without it the peer is named as skipped, with the reason
    expected_skipped = set() if importlib.util.find_spec(peer_module) else {bench.FSSPEC}
    assert set(results["skipped"]) == expected_skipped
    assert set(results["methods"]) == set(bench.METHODS) - expected_skipped
    assert results["nbytes"] > 0 and results["world_size"] == 1
    for name, method in results["methods"].items():
        (run_result,) = method["rounds"]
        assert all(rank["verified"] for rank in run_result["ranks"]), name
        assert method["save_gb_per_s"] > 0 and method["load_gb_per_s"] > 0, name
        assert 0 < method["blocking_median_s"] <= method["save_median_s"], name
        assert method["save_cpu_s_per_gb"] > 0 and method["load_cpu_s_per_gb"] > 0, name
        assert method["server_cpu_s_per_gb"] > 0, name
        assert method["loop_worst_delay_median_s"] >= 0, name
    assert results["methods"][bench.OURS]["most_in_flight"] >= 1
    assert set(results["targets"]) == {"asynctron / raw, save", "asynctron / raw, load"}
    assert "asynctron_over_raw" in results["ratios"]
    printed = run.stdout
    assert "asynctron / raw, save:" in printed and "(target >= 0.9:" in printed
    if not expected_skipped:
        assert results["ratios"]["asynctron_over_fastest_peer"]["load"]["peer"] == bench.FSSPEC
        assert "asynctron / peer, load:" in printed
    assert "unknown" not in results["meta"]["versions"].values()
    if store == "gcs":  # --quick: 1 MiB ranges and parts, several in flight together
        for name in (gcs.RAW, gcs.RAW_COMPOSE, gcs.RAW_RESUMABLE):
            assert results["methods"][name]["most_in_flight"] >= 2, name
        for name in (gcs.RAW_COMPOSE, gcs.RAW_RESUMABLE):
            assert set(results["ratios"]["asynctron_over"][name]) == {"save", "load"}
            assert f"asynctron / {name}: save" in printed
    assert [name for name in os.listdir(str(tmp_path)) if name.startswith("asynctron-bench")
            ] == []  # its scratch directory (and the server's files) is gone

