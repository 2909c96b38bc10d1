"""Smoke test: the save benchmark runs end to end at a tiny size and writes its JSON report.
Only the structure is checked, never the speed."""

from __future__ import annotations

import json

import pytest

from asynctron.bench import save_throughput


@pytest.mark.slow
def test_quick_run_writes_a_complete_report(shm_path: str, tmp_path: object,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/result.json"
    assert save_throughput.main(["--quick", "--targets", shm_path, "--out", out,
                                 "--skip-megatron"]) == 0
    with open(out) as f:
        results = json.load(f)
    assert [s["label"] for s in results["scenarios"]] == ["shm: mixed", "shm: 0.02 GiB tensor"]
    for scenario in results["scenarios"]:
        assert {"raw pwrite+fsync", "asynctron", "asynctron (in place)",
                "asynctron (no checksum)", "asynctron (fresh Engine)", "asynctron.save",
                "torch.save", "dcp (1 thread)", "safetensors"} <= set(scenario["saves"])
        assert any(line.startswith("asynctron.save vs the fastest durable peer")
                   for line in scenario["targets"])
        assert scenario["staged_s"] and min(scenario["loop_worst_delay_s"]) >= 0
        assert any(line.startswith("blocking (await staged)") for line in scenario["targets"])
        assert set(scenario["loads_s"]) >= {"load: raw read", "load: asynctron",
                                             "load: asynctron mmap"}
    assert results["budget"]["peak_borrowed_bytes"] <= results["budget"]["budget_bytes"]
    first = results["first_save"]["targets"]["shm"]["medians"]
    assert set(first) == {"asynctron", "asynctron prefaulted", "asynctron.save", "torch.save",
                          "dcp (4 threads)", "dcp async_save", "safetensors"}
    assert first["asynctron prefaulted"]["prefault_s"] > 0
    assert all(m["blocking_s"] <= m["total_s"] for m in first.values())
    assert "checksum cost:" in capsys.readouterr().out
