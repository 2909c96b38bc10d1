"""Smoke test: the save benchmark across 2 spawned ranks runs at a tiny size (through
`asynctron bench save --nproc 2`) and reports every method. Structure only, never speed."""

from __future__ import annotations

import json

import pytest

from asynctron.cli import main


@pytest.mark.slow
def test_two_rank_quick_run_reports_every_method(tmp_path: object,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/ranks.json"
    assert main(["bench", "save", "--nproc", "2", "--quick", "--target", str(tmp_path),
                 "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    assert results["world_size"] == 2
    assert set(results["saves"]) == {"asynctron", "asynctron (in place)", "dcp.save",
                                     "dcp.async_save", "raw pwrite+fsync (every rank)"}
    assert len(results["per_rank"]["plan_uncached_s"]) == 2
    assert "save vs dcp.async_save" in capsys.readouterr().out
