"""Smoke test: the S3 benchmark starts its own SeaweedFS, runs every method once at a tiny size
(each round-trips its state: the run fails otherwise) and writes its JSON report. Structure
only, never speed."""

from __future__ import annotations

import importlib
import json

import pytest

from asynctron.bench import _s3_methods, s3
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
    assert set(results["skipped"]) <= {_s3_methods.OURS}  # only while asynctron has no S3 backend
    assert set(results["methods"]) == set(_s3_methods.METHODS) - set(results["skipped"])
    assert results["nbytes"] > 0 and results["world_size"] == 1
    for name, method in results["methods"].items():
        (run,) = method["rounds"]
        assert all(rank["verified"] for rank in run["ranks"]), name
        assert method["save_gb_per_s"] > 0 and method["load_gb_per_s"] > 0, name
        assert 0 < method["blocking_median_s"] <= method["save_median_s"], name
        assert method["save_peak_rss_growth_median_bytes"] >= 0, name
        assert method["save_cpu_s_per_gb"] > 0 and method["load_cpu_s_per_gb"] > 0, name
        assert method["load_loop_worst_delay_median_s"] >= 0, name
    for name in (_s3_methods.RAW, _s3_methods.RAW_SIGNED, _s3_methods.TORCH_SAVE):
        assert results["methods"][name]["most_in_flight"] >= 1
    printed = capsys.readouterr().out
    assert "raw signed + checksums / raw unsigned" in printed
    if _s3_methods.OURS in results["methods"]:
        assert results["methods"][_s3_methods.OURS]["most_in_flight"] >= 1
        assert set(results["ratios"]) >= {"asynctron_over_raw", "asynctron_over_fastest_peer"}
        assert "asynctron / fastest peer, save" in printed
        assert results["methods"][_s3_methods.OURS]["load_lists_per_round"] == [1]
        throttle = results["throttle"]
        assert set(throttle["methods"]) == set(_s3_methods.THROTTLE_METHODS)
        assert all(rank["verified"] for method in throttle["methods"].values()
                   for rank in method["rounds"][0]["ranks"])
        assert set(throttle["ratios"]) == {"throttled_over_budget_4",
                                           "proxy_throttled_over_budget_4"}
        assert "throttled / budget 4, no throttle: save" in printed
        assert "proxy throttled / budget 4 via the proxy: save" in printed
        budget_4 = throttle["methods"][_s3_methods.PROXY_BUDGET_4]
        assert budget_4["save_throttled_per_round"] == [0]  # the proxy never refuses 4
    else:
        assert f"not run: {_s3_methods.OURS}" in printed


def test_a_bad_store_profile_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        s3.main(["--quick", "--store-profile", "s3-node,first_byte=soon"])
    assert exit_info.value.code == 2
    assert ("--store-profile: store profile first_byte: expected a duration such as 100ms"
            in capsys.readouterr().err)


@pytest.mark.slow
def test_a_store_profile_puts_a_shaping_proxy_between_the_methods_and_the_server(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """Every method's requests go through the proxy (its counters see the state's bytes both
    ways); the report names the profile."""
    try:
        weed_binary()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    out = f"{tmp_path}/s3.json"
    assert s3.main(["--quick", "--dir", str(tmp_path), "--out", out, "--only", _s3_methods.RAW,
                    "--throttle-gib", "0", "--store-profile", "s3-node,first_byte=5ms"]) == 0
    with open(out) as f:
        results = json.load(f)
    shaped = results["store_profile"]
    assert shaped["profile"].endswith("first_byte=5ms,max_in_flight=none")
    assert shaped["up_bytes"] >= results["nbytes"] and shaped["down_bytes"] >= results["nbytes"]
    assert shaped["num_requests"] > 0 and shaped["num_slowdowns"] == 0
    assert results["meta"]["store_profile"] == "s3-node,first_byte=5ms"
    assert "store profile bandwidth=352MB/s" in capsys.readouterr().out
