"""Smoke test: `asynctron bench data --source s3://...` runs every method once at a tiny size
against the test session's SeaweedFS (beside an idle trainer only, and one DataLoader), prints
the targets, finds the first samples of every method identical and writes its JSON report.
Structure only, never speed."""

from __future__ import annotations

import json

import pytest

from asynctron.bench import data_s3, data_throughput


@pytest.mark.slow
def test_quick_run_matches_samples_across_methods_and_prints_the_targets(
        request: pytest.FixtureRequest, tmp_path: object,
        capsys: pytest.CaptureFixture[str]) -> None:
    for reason in (data_s3.megatron_missing(), data_s3.asynctron_s3_missing()):
        if reason is not None:
            pytest.skip(reason)
    server = request.getfixturevalue("s3_env")  # the session's server, once nothing skips
    out = f"{tmp_path}/data_s3.json"
    assert data_throughput.main(["--source", f"s3://{server.bucket}/bench-data-s3", "--quick",
                                 "--dir", str(tmp_path), "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    summary = results["summary"]
    assert summary["samples_match"] and summary["num_verified"] == 16
    assert results["not_run"] == {}
    labels = {f"{method}, {trainer}" for method in (data_s3.COLD, data_s3.WARM, data_s3.LOCAL)
              for trainer in data_s3.QUICK_TRAINERS}
    labels |= {f"{data_s3.MEGATRON}, idle", f"{data_s3.SUBSET}, idle", f"{data_s3.EPOCH}, idle"}
    labels |= {f"{data_s3.DATALOADER.format(n)}, idle"
               for n in data_s3.QUICK_DATALOADER_WORKERS}
    assert set(summary["medians"]) == labels
    for label, row in summary["medians"].items():
        assert row["samples_per_s"] > 0 and row["wait_max_s"] >= row["wait_p95_s"], label
    assert summary["medians"][f"{data_s3.EPOCH}, idle"]["bytes_fetched"] > 0
    assert len(summary["targets"]) == 6 and results["cache_series"]
    printed = capsys.readouterr().out
    for line in ("asynctron S3 cold / megatron S3 ds[i] (samples/s):",
                 "asynctron S3 warm / asynctron local, idle (samples/s):",
                 "p95 batch wait, asynctron S3 cold, idle (ms):",
                 "bytes fetched / bytes used, an epoch (cold):",
                 "bytes fetched / bytes used, 1% of the samples (cold):",
                 "samples: the first 16 of every method are identical"):
        assert line in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data_s3.json", "data_s3.png"]
