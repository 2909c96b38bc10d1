"""Smoke test: the hostile-metadata benchmark runs at a tiny size and reads every input as a
load does. Structure only (the figures are the benchmark's, not the test's)."""

from __future__ import annotations

import json

import pytest

from asynctron.cli import main


@pytest.mark.slow
def test_quick_run_reads_each_input_in_a_fresh_process(tmp_path: object) -> None:
    out = f"{tmp_path}/hostile.json"
    main(["bench", "hostile", "--quick", "--dir", str(tmp_path), "--out", out])
    with open(out) as f:
        rows = json.load(f)["rows"]
    outcomes = {row["input"]: row["outcome"] for row in rows}
    assert outcomes["real manifest"].startswith("loaded ")
    assert outcomes["real DCP metadata"].startswith("loaded ")
    assert outcomes["real manifest of empty lists"].startswith("loaded 0 items")
    assert outcomes["empty lists"].startswith("refused: CorruptCheckpointError: manifest ")
    assert "field 'junk': expected one of [" in outcomes["empty lists"]
    assert [row["file"] for row in rows] == ["manifest.json"] * 3 + [".metadata"] * 2
    assert all(row["seconds"] > 0 and row["peak_bytes"] >= 0 for row in rows)
    assert rows[3]["seconds_vs_real"] == 1.0  # the real DCP metadata, against itself
