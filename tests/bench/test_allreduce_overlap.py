"""Smoke test: the all-reduce overlap benchmark spawns its 2 ranks, runs asynctron and DDP at a
tiny size and writes its JSON report. Only the structure is checked, never the speed."""

from __future__ import annotations

import json

import pytest

from asynctron.cli import main as cli_main


@pytest.mark.slow
def test_quick_run_writes_a_complete_report(tmp_path: object,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/result.json"
    assert cli_main(["bench", "comm", "--quick", "--models", "0.3M", "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    [model] = results["models"]
    assert model["model"] == "0.3M" and model["all_reduce_all_median_s"] > 0
    assert set(model["buckets"]) == {"1", "4"}
    for row in model["buckets"].values():
        assert row["num_buckets"] >= 1 and row["ratio"] > 0 and row["compute_median_s"] > 0
        assert len(row["asynctron"]) == len(row["ddp"]) == 1
        assert row["asynctron_exposed_median_s"] >= 0 and row["loop_worst_delay_s"] >= 0
    assert results["meta"]["args"]["world_size"] == 2
    assert "asynctron s" in capsys.readouterr().out
