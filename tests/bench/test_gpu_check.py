"""The prepared GPU check without a GPU: its plan fits the 6 minutes, it exits 0 saying why
without CUDA, it finds every CUDA test, it stops a part at its budget, and it renders one report
from canned results with every figure next to its target. Never speed."""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asynctron.bench import _gpu_report, _savers, gpu_check
from asynctron.bench.gpu_check import Part

ROOT = Path(__file__).resolve().parent.parent.parent
GiB = 1 << 30


def test_without_cuda_it_says_so_and_exits_0(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--quick", "--results", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("asynctron bench gpu: no CUDA device here (torch ")
    assert "nothing to run" in out and not (tmp_path / "r").exists()


def test_the_quick_plan_fits_6_minutes_and_names_every_part(
        capsys: pytest.CaptureFixture[str]) -> None:
    quick = gpu_check.plan(quick=True)
    assert [p.name for p in quick] == ["tests", "staging_160", "staging_2590", "load", "trainer"]
    assert sum(p.budget_s for p in quick) + gpu_check.REPORT_RESERVE_S <= 6 * 60 - 20
    assert gpu_check.main(["--quick", "--dry-run", "--disk", "/d", "--shm", "/s"]) == 0
    out = capsys.readouterr().out
    assert "--tensors 160 --repeats 2 --target /d" in out  # load, on the disk
    assert "-m asynctron.bench.cuda_staging --size-gib 4 --repeats 2 --target /s" in out
    assert "tests/engine/test_cuda.py" in out and out.endswith("budget: 330 s\n")


def test_only_picks_parts_and_unknown_ones_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    args, parts = gpu_check.parse_args(["--only", "load,trainer"])
    assert [p.name for p in parts] == ["load", "trainer"]
    assert args.budget_s == sum(p.budget_s for p in parts) + gpu_check.REPORT_RESERVE_S
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "tests,nvlink"])
    assert "found ['nvlink']" in capsys.readouterr().err


def test_the_tests_part_runs_every_file_with_gpu_tests() -> None:
    files = gpu_check.gpu_test_files(ROOT)
    for name in ("tests/engine/test_cuda.py", "tests/comm/test_comm_cuda.py",
                 "tests/bench/test_cuda_staging.py", "tests/bench/test_cuda_trainer.py",
                 "tests/bench/test_cuda_load.py", "tests/datasets/test_loader_workers.py"):
        assert name in files


def _needs_cuda(decorators: list[ast.expr]) -> bool:
    return any("cuda.is_available" in ast.unparse(d) for d in decorators)


def _marked_gpu(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d) in ("pytest.mark.gpu", "gpu") for d in decorators)


def test_every_test_that_needs_cuda_is_marked_gpu() -> None:
    """Invariant: a test skipped without CUDA is in `pytest -m gpu`, so the GPU check runs it."""
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marks = [node.value for node in tree.body if isinstance(node, ast.Assign)
                        and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)]
        module_elements = [e for value in module_marks
                           for e in (value.elts if isinstance(value, ast.List) else [value])]
        if _needs_cuda(module_elements) and _marked_gpu(module_elements):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and node.name.startswith("test_") and _needs_cuda(node.decorator_list)
                    and not _marked_gpu(node.decorator_list)
                    and not _marked_gpu(module_elements)):
                unmarked.append(f"{path.relative_to(ROOT)}::{node.name}")
    assert unmarked == []


def test_a_part_past_its_budget_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "print('started', flush=True)\n"
              "time.sleep(60)\n")
    started = time.perf_counter()
    status, code, seconds = gpu_check.run_part("slow", [sys.executable, "-c", script],
                                               log_path=str(tmp_path / "slow.log"),
                                               timeout_s=3, cwd=str(tmp_path))
    assert (status, code) == ("timed out", None) and seconds < 20
    assert time.perf_counter() - started < 20
    assert (tmp_path / "slow.log").read_text() == "started\n"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_part_that_fails_is_failed(tmp_path: Path) -> None:
    status, code, _ = gpu_check.run_part("bad", [sys.executable, "-c", "raise SystemExit(3)"],
                                         log_path=str(tmp_path / "bad.log"), timeout_s=30,
                                         cwd=str(tmp_path))
    assert (status, code) == ("failed", 3)


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="4"><testcase classname="tests.engine.test_cuda" name="test_a"/>
<testcase classname="tests.engine.test_cuda" name="test_b"><failure message="no"/></testcase>
<testcase classname="tests.comm.test_comm_cuda" name="test_c[nccl]"><skipped/></testcase>
<testcase classname="tests.comm.test_comm_cuda" name="test_c[gloo]"/></testsuite></testsuites>"""


def test_junit_xml_gives_counts_and_the_failing_tests(tmp_path: Path) -> None:
    (tmp_path / "tests.xml").write_text(JUNIT)
    assert _gpu_report.tests_summary(str(tmp_path / "tests.xml")) == {
        "tests": 4, "failures": 1, "errors": 0, "skipped": 1, "passed": 2,
        "failed": ["tests.engine.test_cuda::test_b"]}


def _staging(num_tensors: int, d2h: float, load_s: float) -> dict[str, Any]:
    return {"device": "H100", "nbytes": 4 * GiB, "num_tensors": num_tensors,
            "d2h_vs_raw": d2h, "h2d_vs_raw": 0.95,
            "medians_s": {"raw pinned D2H": 0.083, "asynctron staging": 0.083 / d2h,
                          "raw pinned H2D": 0.08, "asynctron load into GPU": load_s}}


def _trainer_method(blocking: float, step_ratio: float = 1.0) -> dict[str, Any]:
    return {"blocking_s": blocking, "staged_s": blocking, "durable_s": 2.0,
            "previous_wait_s": 0.0, "step_alone_s": 0.04, "step_in_flight_s": 0.04 * step_ratio,
            "step_ratio": step_ratio}


CANNED: dict[str, Any] = {
    "tests": {"tests": 20, "failures": 0, "errors": 0, "skipped": 1, "passed": 19, "failed": []},
    "staging_160": _staging(160, 0.95, 1.0),
    "staging_2590": _staging(2590, 0.45, 2.0),
    "load": {"device": "H100", "nbytes": 2 * GiB, "num_tensors": 160, "target": "/disk",
             "filesystem": "ext4", "bit_exact": {"asynctron load_into": True},
             "medians_s": {"warm": {"raw pread + H2D": 1.0}}, "gb_per_s": {"warm": {
                 "raw pread + H2D": 2.1}},
             "ratios": {"warm": {"ours_vs_raw": 1.1, "plugin_vs_raw": 0.3,
                                 "plugin_vs_stock": 0.26, "plugin_vs_ours": 0.27},
                        "cold": {"ours_vs_raw": 0.92, "plugin_vs_raw": 0.9,
                                 "plugin_vs_stock": 1.2, "plugin_vs_ours": 0.98}}},
    "trainer": {"state": {"nbytes": 3 * GiB, "num_tensors": 200},
                "model": {"num_parameters": 250e6, "hidden": 1024, "num_layers": 16},
                "config": {"save_every": 10, "saves": 2, "wait_staged": "before_step",
                           "target": "/disk"},
                "methods": {_savers.OURS: _trainer_method(0.1, 1.01),
                            _savers.ZOC_PROCESS: _trainer_method(0.3)},
                "not_run": {_savers.MEGATRON: "megatron-core is not importable"},
                "ratios": {"best_zoc": _savers.ZOC_PROCESS, _savers.OURS: {
                    "blocking_vs_best_zoc": 1 / 3, "step_ratio": 1.01,
                    "staged_vs_best_zoc": 1 / 3, "durable_vs_best_zoc": 1.0}}},
}


def _parts(results: dict[str, Any]) -> dict[str, Any]:
    return {name: {"status": "ok" if name in results else "timed out", "budget_s": 60.0,
                   "duration_s": 30.0, "note": "", "command": ["-m", name],
                   "result": results.get(name)} for name in CANNED}


META = {"device": "NVIDIA H100 80GB HBM3", "command": "asynctron bench gpu --quick",
        "host": "gpu-1", "date": "2026-11-30", "torch": "2.11.0+cu130", "cuda": "13.0",
        "python": "3.12.3", "asynctron": "0.1.0", "cpu_count": 16, "duration_s": 301.0,
        "budget_s": 330.0}


def _checks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{c['part']}: {c['figure']}": c for c in report["checks"]}


def test_every_figure_is_next_to_its_target() -> None:
    report = _gpu_report.build(META, _parts(CANNED))
    checks = _checks(report)
    assert checks["tests: CUDA tests (pytest -m gpu)"]["met"] is True
    assert checks["staging_160: D2H staging / raw pinned copy_, 160 tensors"]["met"] is True
    assert checks["staging_2590: D2H staging / raw pinned copy_, 2590 tensors"]["met"] is False
    assert checks["staging: load_into GB/s, 2,590 tensors / 160 tensors"]["value"] == 0.5
    assert checks["load: warm: asynctron.dcp.StorageReader / stock dcp.load"]["met"] is False
    assert checks["load: cold: asynctron.dcp.StorageReader / stock dcp.load"]["met"] is True
    ours = f"trainer: {_savers.OURS}: blocking / {_savers.ZOC_PROCESS}"
    assert checks[ours]["met"] is True and checks[ours]["shown"] == "0.33x"
    step = f"trainer: {_savers.OURS}: step with a save in flight / without"
    assert checks[step]["shown"] == "1.010x" and checks[step]["met"] is True
    background = f"trainer: {_savers.OURS_BACKGROUND}: blocking / {_savers.ZOC_PROCESS}"
    assert checks[background]["met"] is None and checks[background]["shown"] == "not measured"
    assert report["num_not_met"] == 5  # 2,590 staging and load, three warm plugin ratios
    json.dumps(report)  # the JSON report takes it as it is


def test_the_markdown_names_the_device_and_marks_each_target() -> None:
    text = _gpu_report.render_markdown(_gpu_report.build(META, _parts(CANNED)))
    assert text.startswith("# GPU check: NVIDIA H100 80GB HBM3\n")
    assert "torch 2.11.0+cu130 (CUDA 13.0), Python 3.12.3" in text
    assert ("| staging_2590 | D2H staging / raw pinned copy_, 2590 tensors | 0.45x | >= 0.9x "
            "| **not met** |") in text
    assert ("| staging_160 | D2H staging / raw pinned copy_, 160 tensors | 0.95x | >= 0.9x "
            "| met |") in text
    assert f"| {_savers.OURS} | 0.100 | 0.100 | 2.000 | 0.000 | 40.0 | 40.4 | 1.010 |" in text
    assert "- not run: megatron FileSystemWriterAsync: megatron-core is not importable" in text
    assert "| warm | raw pread + H2D | 1.000 | 2.10 |" in text


def test_parts_that_measured_nothing_say_not_measured() -> None:
    report = _gpu_report.build(META, _parts({}))
    assert report["num_met"] == report["num_not_met"] == 0
    assert all(c["shown"] == "not measured" for c in report["checks"])
    text = _gpu_report.render_markdown(report)
    assert "| trainer | timed out | 30 | 60 |" in text


def test_a_run_with_canned_parts_writes_one_report(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole command on the CPU, its parts replaced by scripts that write canned results
    (one outlives its budget): the report says what each part did."""

    def canned(name: str) -> Part:
        (tmp_path / f"{name}.canned").write_text(json.dumps(CANNED[name]))
        script = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])"
        return Part(name=name, args=("-c", script, str(tmp_path / f"{name}.canned"), "{out}"),
                    budget_s=30, result_file=f"{name}.json")

    parts = [canned("staging_160"), canned("staging_2590"),
             Part(name="trainer", args=("-c", "import time; time.sleep(30)"), budget_s=1,
                  result_file="trainer.json")]
    monkeypatch.setattr(gpu_check, "plan", lambda quick: parts)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "machine", lambda started, argv, budget: dict(
        META, command=" ".join(["asynctron bench gpu", *argv]), budget_s=budget))
    results = tmp_path / "results"
    assert gpu_check.main(["--quick", "--results", str(results), "--disk",
                           str(tmp_path / "disk")]) == 1  # the trainer timed out
    assert sorted(os.listdir(results)) == [
        "gpu_report.json", "gpu_report.md", "staging_160.json", "staging_160.log",
        "staging_2590.json", "staging_2590.log", "trainer.log"]
    with open(results / "gpu_report.json") as f:
        report = json.load(f)
    assert {name: part["status"] for name, part in report["parts"].items()} == {
        "staging_160": "ok", "staging_2590": "ok", "trainer": "timed out"}
    assert report["parts"]["trainer"]["note"] == "stopped after 1 s"
    checks = _checks(report)
    assert checks["staging_160: D2H staging / raw pinned copy_, 160 tensors"]["met"] is True
    assert checks["tests: CUDA tests (pytest -m gpu)"]["shown"] == "not measured"
    assert report["meta"]["command"].endswith("--disk " + str(tmp_path / "disk"))
