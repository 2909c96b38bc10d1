"""Where a benchmark's files go: its scratch directory on the storage under test, the run's
metadata, and a JSON file at `--out` (a `.json` path, or a directory), by default
./asynctron-bench/<scenario>_<host>_<yyyymmdd>.json."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import tempfile
import time
from typing import Any

import asynctron

#: Where results go when a scenario is not given `--out`, relative to the working directory.
DEFAULT_RESULTS_DIR = "asynctron-bench"
#: The help of every scenario's `--out`.
OUT_HELP = "results: a .json path or a directory (default: ./asynctron-bench)"


def description(doc: str | None) -> str:
    """A scenario's `--help` description: its module docstring's first paragraph on one line,
    in whole sentences (where its first line alone may stop mid-sentence)."""
    return " ".join((doc or "").split("\n\n")[0].split())


def scratch_dir(prefix: str, parent: str) -> str:
    """A new directory for a run's files inside `parent` (created if missing)."""
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def versions(names: tuple[str, ...]) -> dict[str, str]:
    """Each distribution's installed version ("not installed" where it is not), for a run's
    metadata."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def run_meta(started_unix_s: float, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """What every result file records about the run, plus `extra` (versions, config, ...)."""
    return {"date": time.strftime("%Y-%m-%d", time.gmtime(started_unix_s)),
            "host": platform.node(), "cpu_count": os.cpu_count(),
            "kernel": platform.release(), "python": platform.python_version(),
            "asynctron": asynctron.__version__, **extra, "args": vars(args),
            "duration_s": time.time() - started_unix_s}


def results_path(scenario: str, out: str | None) -> str:
    """The JSON file a scenario writes: `out` if it names a `.json` file, else the dated file
    `<scenario>_<host>_<yyyymmdd>.json` in the directory `out` (default ./asynctron-bench/)."""
    if out is not None and out.endswith(".json"):
        return out
    return os.path.join(out or DEFAULT_RESULTS_DIR,
                        f"{scenario}_{platform.node()}_{time.strftime('%Y%m%d')}.json")


def write_results(scenario: str, results: dict[str, Any], *, out: str | None) -> str:
    """Write `results` where `results_path` says, creating its directory; returns the path."""
    path = results_path(scenario, out)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\nresults: {path}")
    return path
