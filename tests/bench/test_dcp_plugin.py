"""Smoke test: the DCP plugin benchmark runs end to end at a tiny size and writes its JSON
report. Only the structure is checked, never the speed."""

from __future__ import annotations

import json

import pytest

from asynctron.bench import dcp_plugin


@pytest.mark.slow
def test_quick_run_writes_a_complete_report(shm_path: str, tmp_path: object,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/result.json"
    assert dcp_plugin.main(["--quick", "--size-gib", "0.004", "--target", shm_path,
                            "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    (summary,) = results["targets"]
    assert summary["target"] == shm_path and summary["nbytes"] > 0
    assert set(summary["save_median_s"]) == {
        "raw pwrite+fsync", "asynctron.dcp", "stock FileSystemWriter (1 thread)",
        "stock FileSystemWriter (2 threads)", "stock FileSystemWriter (4 threads)"}
    assert set(summary["async_blocking_median_s"]) == {
        "stock async_save (FileSystemWriter, 1 thread)",
        "stock async_save (FileSystemWriter, 4 threads)", "asynctron.dcp async_save"}
    assert summary["save_ratio"] > 0 and summary["async_blocking_ratio"] > 0
    assert all(blocked <= summary["async_total_median_s"][name]
               for name, blocked in summary["async_blocking_median_s"].items())
    printed = capsys.readouterr().out
    assert "[target >= 1.0x]" in printed and "[target <= 0.5x]" in printed
