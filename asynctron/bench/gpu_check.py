"""The prepared GPU check (`asynctron bench gpu`): every CUDA test and every CUDA benchmark in one
command, each part in its own process under its own time budget, then ONE report (markdown and
JSON) with the device, the versions and every figure next to its target.

Parts, in order (`--quick`: sized to finish within 6 minutes on one H100):
- `tests`: `pytest -m gpu` over the test files that mark tests `gpu` (from a source checkout);
- `staging_160`, `staging_2590`: `asynctron bench cuda`, 4 GiB in 160 tensors and in the mixed
  layout's 2,590: D2H staging and load_into against raw pinned copies;
- `load`: `asynctron bench cuda --mode load`: load_into and the DCP plugin into GPU tensors,
  warm and cold, against stock `dcp.load` and raw pread + H2D;
- `trainer`: `asynctron bench cuda --mode trainer`: a GPT-like model checkpointing every N
  steps through asynctron, BackgroundEngine, DCP's zero-overhead `async_save` (thread and
  process) and, where they import, DCP's default and Megatron's writer.
A part that outlives its budget is stopped (its whole process group) and reported as timed out,
with what it wrote by then; the parts after it still run, within the run's total budget.
Nothing needs the network. Without CUDA it says so and exits 0 (`--dry-run` prints the plan).

Run from a source checkout (`pip install -e . --no-deps` builds the C extension):
`python -m asynctron bench gpu --quick`. Exit status: 0 when every part ran to the end (targets
met or not: the report says), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import asynctron
from asynctron.bench import _gpu_report
from asynctron.bench._results import DEFAULT_RESULTS_DIR, description

#: seconds kept back from the total budget for writing the report
REPORT_RESERVE_S = 5.0
#: seconds a stopped part gets between SIGTERM and SIGKILL
STOP_GRACE_S = 5.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Part:
    """One part of the check: the Python interpreter's `args` (`{out}`: the part's result
    file; `{shm}`, `{disk}`: scratch directories), its budget and its result file's name."""

    name: str
    args: tuple[str, ...]
    budget_s: float
    result_file: str


def plan(quick: bool) -> list[Part]:
    """The parts and their budgets: `quick` (within 6 minutes on one H100) or full (~15)."""
    staging = ("-m", "asynctron.bench.cuda_staging", "--size-gib", "4", "--repeats",
               "2" if quick else "5", "--target", "{shm}", "--out", "{out}")
    load = ("-m", "asynctron.bench.cuda_load", "--size-gib", "2" if quick else "4", "--tensors",
            "160", "--repeats", "2" if quick else "3", "--target", "{disk}", "--out", "{out}")
    model = (("--hidden", "1024", "--layers", "16", "--saves", "2", "--steps-alone", "10",
              "--methods", "asynctron,dcp async_save zoc (process),dcp async_save zoc (thread),"
              "asynctron BackgroundEngine,megatron FileSystemWriterAsync")
             if quick else ())
    trainer = ("-m", "asynctron.bench.cuda_trainer", *model, "--target", "{disk}", "--out", "{out}")
    return [
        Part(name="tests", args=("-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "gpu",
                                 "--junitxml", "{out}"),
             budget_s=70 if quick else 150, result_file="tests.xml"),
        Part(name="staging_160", args=(*staging, "--tensors", "160"),
             budget_s=30 if quick else 60, result_file="staging_160.json"),
        Part(name="staging_2590", args=staging, budget_s=35 if quick else 75,
             result_file="staging_2590.json"),
        Part(name="load", args=load, budget_s=75 if quick else 200, result_file="load.json"),
        Part(name="trainer", args=trainer, budget_s=115 if quick else 420,
             result_file="trainer.json"),
    ]


def source_root() -> Path | None:
    """The source checkout asynctron runs from (with its tests), or None (a wheel)."""
    root = Path(asynctron.__file__).resolve().parent.parent
    return root if (root / "tests" / "conftest.py").is_file() else None


def gpu_test_files(root: Path) -> list[str]:
    """The test files (relative to `root`) that mark tests `gpu`."""
    return sorted(str(path.relative_to(root)) for path in (root / "tests").rglob("test_*.py")
                  if "mark.gpu" in path.read_text())


def command(part: Part, *, out: str, shm: str, disk: str, root: Path | None) -> list[str] | None:
    """The part's command line, or None where it cannot run (the tests without a checkout)."""
    args = [arg.format(out=out, shm=shm, disk=disk) for arg in part.args]
    if part.name == "tests":
        if root is None:
            return None
        args += gpu_test_files(root)
    return [sys.executable, *args]


def run_part(name: str, argv: list[str], *, log_path: str, timeout_s: float, cwd: str
             ) -> tuple[str, int | None, float]:
    """Run `argv` in a new session, its output into `log_path` and echoed with `[name]`; stop
    its process group after `timeout_s`. Returns (status, exit code, seconds)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env.get("PYTHONPATH")]))
    started = time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=env,
            start_new_session=True, text=True, errors="replace") as process:

        def echo() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                print(f"  [{name}] {line}", end="", flush=True)

        reader = threading.Thread(target=echo, name=f"echo-{name}", daemon=True)
        reader.start()
        try:
            returncode: int | None = process.wait(timeout=timeout_s)
            status = "ok" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop(process)
            returncode, status = None, "timed out"
        reader.join(timeout=STOP_GRACE_S)
    return status, returncode, time.perf_counter() - started


def _stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM the part's process group (the part and what it started), SIGKILL if it stays."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def read_result(part: Part, path: str) -> dict[str, Any] | None:
    """What the part wrote (a run cut short may have written some), or None."""
    if not os.path.exists(path):
        return None
    try:
        if part.name == "tests":
            return _gpu_report.tests_summary(path)
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:  # a file cut off mid-write by a stop
        print(f"  [{part.name}] unreadable result {path}: {exc}", flush=True)
        return None


def machine(started_unix_s: float, argv: list[str], budget_s: float) -> dict[str, Any]:
    """The run's device, versions and command."""
    device = torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(device)
    return {"device": torch.cuda.get_device_name(device),
            "device_memory_bytes": properties.total_memory,
            "compute_capability": f"{properties.major}.{properties.minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "asynctron": asynctron.__version__,
            "host": platform.node(), "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d", time.gmtime(started_unix_s)),
            "command": " ".join(["asynctron bench gpu", *argv]), "budget_s": budget_s}


def write_report(report: dict[str, Any], results: str) -> tuple[str, str]:
    """`gpu_report.json` and `gpu_report.md` in `results`; returns their paths."""
    json_path = os.path.join(results, "gpu_report.json")
    md_path = os.path.join(results, "gpu_report.md")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(_gpu_report.render_markdown(report))
    return json_path, md_path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynctron bench gpu",
                                     description=description(__doc__))
    parser.add_argument("--quick", action="store_true",
                        help="sizes and budgets for a run within 6 minutes on one H100")
    parser.add_argument("--only", default=None,
                        help="comma-separated subset of tests,staging_160,staging_2590,load,"
                             "trainer")
    parser.add_argument("--results", default=None,
                        help="directory for the report and each part's result and log "
                             "(default: ./asynctron-bench/gpu_<host>_<yyyymmdd>)")
    parser.add_argument("--disk", default=os.path.join(os.getcwd(), "asynctron-bench-tmp"),
                        help="scratch directory on the disk (loads, trainer checkpoints)")
    parser.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="scratch directory in memory (staging; default /dev/shm)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole run's budget (default: the parts' budgets added up)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[Part]]:
    """Arguments, and the parts they select."""
    parser = _parser()
    args = parser.parse_args(argv)
    parts = plan(args.quick)
    if args.only is not None:
        names = [n for n in args.only.split(",") if n]
        unknown = sorted(set(names) - {p.name for p in parts})
        if unknown:
            parser.error(f"--only: expected names from {[p.name for p in parts]}, found "
                         f"{unknown}")
        parts = [p for p in parts if p.name in names]
    if args.budget_s is None:
        args.budget_s = sum(p.budget_s for p in parts) + REPORT_RESERVE_S
    args.shm = args.shm or args.disk
    return args, parts


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, parts = parse_args(argv)
    root = source_root()
    if args.dry_run:
        for part in parts:
            line = command(part, out=f"<results>/{part.result_file}", shm=args.shm,
                           disk=args.disk, root=root)
            shown = shlex.join(line[1:]) if line else "not run: no source checkout"
            print(f"{part.name:<13}{part.budget_s:>5.0f} s  {shown}")
        print(f"budget: {args.budget_s:.0f} s")
        return 0
    if not torch.cuda.is_available():
        print(f"asynctron bench gpu: no CUDA device here (torch {torch.__version__}, CUDA "
              f"build {torch.version.cuda or 'none'}); nothing to run. Run it on a machine "
              "with an NVIDIA GPU: `python -m asynctron bench gpu --quick` from a source "
              "checkout (`--dry-run` prints the plan).")
        return 0
    started_unix, started = time.time(), time.perf_counter()
    results = os.path.abspath(args.results or os.path.join(
        DEFAULT_RESULTS_DIR, f"gpu_{platform.node()}_{time.strftime('%Y%m%d')}"))
    os.makedirs(results, exist_ok=True)
    for scratch in (args.disk, args.shm):
        os.makedirs(scratch, exist_ok=True)
    cwd = str(root) if root is not None else os.getcwd()
    records: dict[str, Any] = {}
    for index, part in enumerate(parts, start=1):
        out = os.path.join(results, part.result_file)
        argv_part = command(part, out=out, shm=args.shm, disk=args.disk, root=root)
        left_s = args.budget_s - (time.perf_counter() - started) - REPORT_RESERVE_S
        record: dict[str, Any] = {"budget_s": part.budget_s, "command": argv_part[1:]
                                  if argv_part else None, "duration_s": 0.0, "note": "",
                                  "log": None, "result": None}
        records[part.name] = record
        if argv_part is None:
            record.update(status="not run", note="no source checkout: the tests are not here")
        elif left_s < 1:
            record.update(status="not run", note="the run's budget was spent")
        else:
            timeout_s = min(part.budget_s, left_s)
            print(f"[{index}/{len(parts)}] {part.name} (budget {timeout_s:.0f} s): "
                  f"{shlex.join(argv_part[1:])}", flush=True)
            record["log"] = os.path.join(results, f"{part.name}.log")
            status, returncode, seconds = run_part(part.name, argv_part,
                                                   log_path=record["log"],
                                                   timeout_s=timeout_s, cwd=cwd)
            record.update(status=status, returncode=returncode, duration_s=seconds)
            if status == "timed out":
                record["note"] = f"stopped after {timeout_s:.0f} s"
            elif status == "failed":
                record["note"] = f"exit status {returncode}; see {part.name}.log"
            print(f"[{index}/{len(parts)}] {part.name}: {status} in {seconds:.0f} s",
                  flush=True)
        record["result"] = read_result(part, out)
    meta = machine(started_unix, argv, args.budget_s)
    meta["duration_s"] = time.perf_counter() - started
    report = _gpu_report.build(meta, records)
    json_path, md_path = write_report(report, results)
    with open(md_path) as f:
        print("\n" + f.read())
    print(f"report: {md_path} and {json_path}")
    return 0 if all(r["status"] == "ok" for r in records.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
