"""Where a benchmark's results go: the run's metadata and the JSON file
bench/results/<scenario>_<host>_<yyyymmdd>.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import asynctron


def run_meta(started_unix_s: float, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """What every result file records about the run, plus `extra` (versions, config, ...)."""
    return {"date": time.strftime("%Y-%m-%d", time.gmtime(started_unix_s)),
            "host": platform.node(), "cpu_count": os.cpu_count(),
            "kernel": platform.release(), "python": platform.python_version(),
            "asynctron": asynctron.__version__, **extra, "args": vars(args),
            "duration_s": time.time() - started_unix_s}


def write_results(scenario: str, results: dict[str, Any], *, out: str | None,
                  quick: bool) -> str | None:
    """Write `results` to `out`, or to the dated file under bench/results/ (a `--quick` smoke
    run writes only where `out` says); returns the path written, if any."""
    path = out or os.path.join(os.path.dirname(__file__), "results",
                               f"{scenario}_{platform.node()}_{time.strftime('%Y%m%d')}.json")
    if quick and not out:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\nresults: {path}")
    return path
