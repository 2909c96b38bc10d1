"""Smoke test: the data benchmark runs end to end at a tiny size and writes its JSON report.
Only the structure is checked, never the speed."""

from __future__ import annotations

import json

import pytest

from asynctron.bench import data_throughput


@pytest.mark.slow
def test_quick_run_writes_a_complete_report(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/result.json"
    assert data_throughput.main(["--quick", "--dir", str(tmp_path), "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    timings = results["index_build"]["timings_s"]
    assert {"asynctron sample index (numpy)", "asynctron GPTDataset build",
            "asynctron blending index (C)"} <= set(timings)
    assert "asynctron blending index (C)" in results["index_build"]["blend_peak_rss_growth_bytes"]
    scale = results["blend_scale"]
    assert scale["samples"] == 200_000 and len(scale["asynctron"]["seconds"]) == 1
    assert set(results["warm"]) == {"create_attention_mask=True", "create_attention_mask=False"}
    cold = results["cold"]
    assert {"asynctron AsyncLoader (prefetch)", "asynctron ds[i] (no prefetch)"} <= set(
        cold["samples_per_s"])
    assert cold["loop_worst_delay_s"] >= 0
    if results["megatron"] is None:  # megatron-core imported: its rows are there too
        assert "megatron sample index (C++)" in timings and "megatron ds[i]" in cold["timings_s"]
        assert scale["identical"] is True
    assert "cold epoch" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # scratch removed
