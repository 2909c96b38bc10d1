"""What every benchmark scenario shares: the common flags, the machine record, and where the
JSON results go (`bench/results/<scenario>_<host>_<yyyymmdd>.json`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import psutil

import asynctron


def add_common_arguments(parser: argparse.ArgumentParser, *, repeats: int,
                         skip_megatron_help: str) -> None:
    """`--repeats`, `--quick`, `--out` and `--skip-megatron`."""
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke)")
    parser.add_argument("--out", default=None, help="JSON results path")
    parser.add_argument("--skip-megatron", action="store_true", help=skip_megatron_help)


def machine_record(started: float, args: argparse.Namespace) -> dict[str, Any]:
    """Date, host, CPUs, memory, versions and arguments of a run that started at `started`."""
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "host": platform.node(), "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total, "python": platform.python_version(),
        "asynctron": asynctron.__version__, "args": vars(args),
        "duration_s": time.time() - started,
    }


def write_results(results: dict[str, Any], scenario: str, args: argparse.Namespace) -> None:
    """Write `results` as JSON to `args.out` or the scenario's default path (not for a
    `--quick` run without `--out`), and print where."""
    path = args.out or os.path.join(
        os.path.dirname(__file__), "results",
        f"{scenario}_{platform.node()}_{time.strftime('%Y%m%d')}.json")
    if not args.quick or args.out:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"\nresults: {path}")
