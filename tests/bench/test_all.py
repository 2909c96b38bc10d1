"""Smoke test: `asynctron bench all --quick` runs the chosen scenarios and renders the report
with its tables and plots. Structure only, never speed."""

from __future__ import annotations

import os

import pytest

from asynctron.cli import main


@pytest.mark.slow
def test_quick_run_renders_a_report_with_tables_and_plots(tmp_path: object) -> None:
    root = str(tmp_path)
    assert main(["bench", "all", "--quick", "--only", "save,write,cuda", "--results",
                 f"{root}/results", "--docs", f"{root}/docs", "--disk", f"{root}/disk"]) == 0
    with open(f"{root}/docs/benchmarks.md") as f:
        text = f.read()
    for heading in ("## Machine", "## Checkpoint save and load, one process (issue 2)",
                    "## Concurrent write sweep (issue 6)", "## Save across 2 ranks (issue 5)"):
        assert heading in text
    assert "| asynctron |" in text and "Recommended for this storage: `Engine(" in text
    assert "Not run here." in text  # the scenarios left out say so
    for plot in ("benchmarks_save.png", "benchmarks_write.png"):
        assert os.path.getsize(f"{root}/docs/{plot}") > 0
