"""Smoke test: the write sweep runs a tiny grid and writes its table, JSON, plot and advice.
Only the structure is checked, never the speed."""

from __future__ import annotations

import json
import os

import pytest

from bench import write_sweep


@pytest.mark.slow
def test_quick_sweep_reports_every_setting_and_a_recommendation(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/sweep.json"
    target = f"{tmp_path}/storage"
    os.mkdir(target)
    assert write_sweep.main(["--quick", "--target", target, "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    modes = 2 if results["direct_io_available"] else 1
    assert len(results["results"]) == 2 * 2 * 2 * modes  # bins x threads x item sizes x modes
    assert "raw pwrite+fsync (1 thread)" in results["baselines_gb_per_s"]
    assert set(results["recommended"]) >= {"num_bins", "num_workers", "direct_io"}
    assert os.path.getsize(out.replace(".json", ".png")) > 0
    assert os.listdir(target) == []  # the sweep cleans up after itself
    assert "recommended for this storage: Engine(num_workers=" in capsys.readouterr().out


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
