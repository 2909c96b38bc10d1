"""Smoke test: the save benchmark runs end to end at a tiny size and writes its JSON report.
Only the structure is checked, never the speed."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asynctron.bench import first_save, save_throughput


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
    assert set(first) == set(first_save.QUICK_METHODS)
    assert first["asynctron prefaulted"]["prefault_s"] > 0
    assert all(m["blocking_s"] <= m["total_s"] for m in first.values())
    assert "checksum cost:" in capsys.readouterr().out


@pytest.mark.parametrize("method", sorted(set(first_save.METHODS) - set(first_save.QUICK_METHODS)))
def test_first_save_runs_each_peer_the_smoke_run_leaves_out(method: str, tmp_path: object
                                                             ) -> None:
    """In this process (the full run gives each a fresh one): the saver runs and is timed."""
    state = {"w": torch.randn(1 << 16), "b": torch.zeros(7)}
    timings = first_save.run(method, state, f"{tmp_path}/first")
    assert 0 < timings["blocking_s"] <= timings["total_s"]
    saved = f"{tmp_path}/first"  # a file or a directory, as the saver makes it
    assert os.path.isfile(saved) or os.listdir(saved)
