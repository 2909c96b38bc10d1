"""Smoke test: the S3 benchmark starts its own SeaweedFS, runs every method once at a tiny size
(each round-trips its state: the run fails otherwise) and writes its JSON report. Structure
only, never speed."""

from __future__ import annotations

import importlib
import json

import pytest

from asynctron.bench import s3
from asynctron.testing.seaweedfs import weed_binary


def _missing() -> str | None:
    """Why the benchmark cannot run here: no `weed` binary, or a peer that does not import."""
    try:
        weed_binary()
    except FileNotFoundError as error:
        return str(error)
    for module in ("s3fs", "s3torchconnector.dcp"):
        try:
            importlib.import_module(module)
        except ImportError as error:
            return f"{module} is not importable: {error}"
    return None


@pytest.mark.slow
def test_quick_run_round_trips_every_method_and_writes_a_complete_report(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    if (reason := _missing()) is not None:
        pytest.skip(reason)
    out = f"{tmp_path}/s3.json"
    assert s3.main(["--quick", "--dir", str(tmp_path), "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    assert set(results["skipped"]) <= {s3.OURS}  # only while asynctron has no S3 backend
    assert set(results["methods"]) == set(s3.METHODS) - set(results["skipped"])
    assert results["nbytes"] > 0 and results["world_size"] == 1
    for name, method in results["methods"].items():
        (run,) = method["rounds"]
        assert all(rank["verified"] for rank in run["ranks"]), name
        assert method["save_gb_per_s"] > 0 and method["load_gb_per_s"] > 0, name
        assert 0 < method["blocking_median_s"] <= method["save_median_s"], name
        assert method["save_peak_rss_growth_median_bytes"] >= 0, name
        assert method["save_cpu_s_per_gb"] > 0 and method["load_cpu_s_per_gb"] > 0, name
        assert method["load_loop_worst_delay_median_s"] >= 0, name
    for name in (s3.RAW, s3.RAW_SIGNED, s3.TORCH_SAVE):
        assert results["methods"][name]["most_in_flight"] >= 1
    printed = capsys.readouterr().out
    assert "raw signed + checksums / raw unsigned" in printed
    if s3.OURS in results["methods"]:
        assert results["methods"][s3.OURS]["most_in_flight"] >= 1
        assert set(results["ratios"]) >= {"asynctron_over_raw", "asynctron_over_fastest_peer"}
        assert "asynctron / fastest peer, save" in printed
        assert results["methods"][s3.OURS]["load_lists_per_round"] == [1]
        throttle = results["throttle"]
        assert set(throttle["methods"]) == set(s3.THROTTLE_METHODS)
        assert all(rank["verified"] for method in throttle["methods"].values()
                   for rank in method["rounds"][0]["ranks"])
        assert "throttled_over_budget_4" in throttle["ratios"]
        assert "throttled / budget 4, no throttle: save" in printed
    else:
        assert f"not run: {s3.OURS}" in printed
