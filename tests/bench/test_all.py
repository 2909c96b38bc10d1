"""Smoke test: `asynctron bench all --quick` runs the chosen scenarios into one results directory,
and the source tree's `bench/report.py` renders the report with its tables and plots from it.
Structure only, never speed."""

from __future__ import annotations

import os
import shutil

import pytest

from asynctron.bench.all import RUNS
from asynctron.cli import main
from bench import report

COMMITTED_RUN = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "results",
                             "all_vm_20261124")


@pytest.mark.slow
def test_quick_run_writes_results_and_the_report_renders_them(tmp_path: object) -> None:
    """A cheap scenario runs into a copy of a committed full run; the report renders every
    section from it (the committed figures, the fresh comm result)."""
    root = str(tmp_path)
    results = f"{root}/results"
    shutil.copytree(COMMITTED_RUN, results)
    os.remove(f"{results}/{RUNS['comm'].result_file}")
    assert main(["bench", "all", "--quick", "--only", "comm,cuda", "--results", results,
                 "--disk", f"{root}/disk"]) == 0
    assert os.path.exists(f"{results}/{RUNS['comm'].result_file}")
    assert not os.path.exists(f"{results}/{RUNS['cuda'].result_file}")  # no GPU: no cuda
    report.render(results, f"{root}/docs")
    with open(f"{root}/docs/benchmarks.md") as f:
        text = f.read()
    for heading in ("## Machine", "## Checkpoint save and load, one process (issue 2)",
                    "## Concurrent write sweep (issue 6)", "## Save across 2 ranks (issue 5)"):
        assert heading in text
    assert "| asynctron |" in text and "Recommended for this storage: `Engine(" in text
    assert "Not run here" in text  # the scenarios left out say so
    for plot in ("benchmarks_save.png", "benchmarks_write.png"):
        assert os.path.getsize(f"{root}/docs/{plot}") > 0


def test_every_scenario_of_the_full_run_is_a_module_of_the_package() -> None:
    import importlib.util

    for name, run in RUNS.items():
        assert importlib.util.find_spec(f"asynctron.bench.{run.module}") is not None, name
