"""Smoke test: `asynctron bench all --quick` runs the chosen scenarios into one results directory,
and the source tree's `bench/report.py` renders the report with its tables and plots from it.
Structure only, never speed."""

from __future__ import annotations

import os

import pytest

from asynctron.bench.all import RUNS
from asynctron.cli import main
from bench import report


@pytest.mark.slow
def test_quick_run_writes_results_and_the_report_renders_them(tmp_path: object) -> None:
    root = str(tmp_path)
    assert main(["bench", "all", "--quick", "--only", "save,write,cuda", "--results",
                 f"{root}/results", "--disk", f"{root}/disk"]) == 0
    assert sorted(os.listdir(f"{root}/results")) == sorted(
        [RUNS["save"].result_file, RUNS["write"].result_file, "write.png"])  # no GPU: no cuda
    report.render(f"{root}/results", f"{root}/docs")
    with open(f"{root}/docs/benchmarks.md") as f:
        text = f.read()
    for heading in ("## Machine", "## Checkpoint save and load, one process (issue 2)",
                    "## Concurrent write sweep (issue 6)", "## Save across 2 ranks (issue 5)"):
        assert heading in text
    assert "| asynctron |" in text and "Recommended for this storage: `Engine(" in text
    assert "Not run here." in text  # the scenarios left out say so
    for plot in ("benchmarks_save.png", "benchmarks_write.png"):
        assert os.path.getsize(f"{root}/docs/{plot}") > 0


def test_every_scenario_of_the_full_run_is_a_module_of_the_package() -> None:
    import importlib.util

    for name, run in RUNS.items():
        assert importlib.util.find_spec(f"asynctron.bench.{run.module}") is not None, name
