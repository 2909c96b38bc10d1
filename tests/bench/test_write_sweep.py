"""Smoke test: the write sweep runs a tiny grid and writes its table, JSON, plot and advice.
Only the structure is checked, never the speed."""

from __future__ import annotations

import json
import os

import pytest

from asynctron.bench import write_sweep
from asynctron.cli import main


@pytest.mark.slow
def test_quick_sweep_reports_every_setting_and_a_recommendation(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/sweep.json"
    target = f"{tmp_path}/storage"
    os.mkdir(target)
    assert write_sweep.main(["--quick", "--size-mib", "16", "--bins", "1,2", "--threads", "1,2",
                             "--item-sizes-mib", "0.25,8", "--target", target, "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    modes = 2 if results["direct_io_available"] else 1
    assert len(results["results"]) == 2 * 2 * 2 * modes  # bins x threads x item sizes x modes
    assert "raw pwrite+fsync (1 thread)" in results["baselines_gb_per_s"]
    assert set(results["recommended"]) >= {"num_bins", "num_workers", "direct_io"}
    assert os.path.getsize(out.replace(".json", ".png")) > 0
    assert os.listdir(target) == []  # the sweep cleans up after itself
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("recommended for this storage: Engine(num_workers=")


@pytest.mark.slow
def test_cli_from_any_directory_writes_results_under_the_working_directory(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(str(tmp_path))  # not a source checkout: no bench/ here
    os.mkdir("storage")
    assert main(["bench", "write", "--quick", "--size-mib", "8", "--bins", "2", "--threads", "2",
                 "--item-sizes-mib", "1", "--target", "storage"]) == 0
    results, picture = sorted(os.listdir("asynctron-bench"))
    assert results.startswith("write_sweep_") and results.endswith(".json")
    assert picture == results.replace(".json", ".png")
    assert "GB/s" in capsys.readouterr().out


def test_quick_fills_in_only_what_the_command_line_left_out() -> None:
    assert set(write_sweep.QUICK_GRID) == set(write_sweep.FULL_GRID)


def test_recommendation_prefers_fewer_threads_within_five_percent() -> None:
    def result(bins: int, threads: int, item_bytes: int, speed: float,
               delay: float) -> write_sweep.Result:
        return write_sweep.Result(write_sweep.Setting(bins, threads, item_bytes, True), speed,
                                  [], delay)

    results = [result(8, 8, 1 << 20, 3.0, 4.0), result(8, 8, 1 << 30, 3.0, 4.0),
               result(2, 2, 1 << 20, 2.9, 2.0), result(2, 2, 1 << 30, 2.9, 2.0),
               result(4, 8, 1 << 20, 3.5, 2.0), result(4, 8, 1 << 30, 3.5, 50.0)]
    choice = write_sweep.recommend(results, max_loop_delay_ms=10.0)
    assert (choice.num_bins, choice.num_workers) == (2, 2)  # (4, 8) stalls the loop once
    assert choice.mean_gb_per_s == pytest.approx(2.9)
