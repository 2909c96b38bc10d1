"""The `asynctron` command line, run in-process through `main([...])`.

Sync tests on purpose: `main()` runs its own event loop.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import asynctron
from asynctron._knobs import STORE_DEADLINE_S, store_deadline_hint
from asynctron.bench import SCENARIOS
from asynctron.cli import format_nbytes, main
from asynctron.storage import register_backend
from asynctron.storage.backends.local import read_manifest


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint root holding `step_3` and a `latest` pointer to it."""
    state = {
        "model": {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, 5)},
        "blob": b"hello",
        "step": 3,
    }
    asynctron.save(state, tmp_path / "step_3")
    return tmp_path


def test_inspect_prints_every_key_and_totals(root: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {root / 'step_3'} (named by {root}'s latest)\n" in out
    for key in ("model.w", "model.b", "blob"):
        assert re.search(rf"^{re.escape(key)}\s", out, re.MULTILINE), out
    assert "[3, 5]" in out and "16.0 KiB" in out
    assert re.search(r"^values:\n  step  3$", out, re.MULTILINE), out
    assert re.search(r"^3 items, 16\.1 KiB \(16449 bytes\) in \d files, 1 values, created ",
                     out, re.MULTILINE), out


def test_inspect_names_the_checkpoint_itself_when_asked_for_it(
        root: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["inspect", str(root / "step_3")]) == 0
    assert f"checkpoint {root / 'step_3'}\n" in capsys.readouterr().out


def test_inspect_json_lists_the_manifest_items_and_values(
        root: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["inspect", "--json", str(root)]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["checkpoint"] == str(root / "step_3") and found["requested"] == str(root)
    assert found["values"] == {"step": 3}
    by_key = {item["key"]: item for item in found["items"]}
    assert set(by_key) == {"model.w", "model.b", "blob"}
    assert by_key["model.w"]["shape"] == [4096] and by_key["model.w"]["nbytes"] == 16384
    assert by_key["blob"]["kind"] == "bytes" and by_key["blob"]["dtype"] is None


@pytest.mark.parametrize(("path", "message"), [
    ("s3://", r"expected s3://bucket/key with a non-empty bucket"),
    ("s3://b//x", r"no empty, '\.' or '\.\.' key parts"),
    ("s3a://b/x", r"found the scheme 's3a'; did you mean 's3://b/x'\?"),
    ("s3:/b/x", r"did you mean 's3://b/x'\?"),
    ("hdfs://b/x", r"found the scheme 'hdfs'; a URL is never taken for a local path"),
])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_bad_url_is_one_line_and_exit_2(command: str, path: str, message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(rf"asynctron {command}: path {re.escape(repr(path))}: [^\n]*"
                        rf"{message}[^\n]*\n", captured.err), captured.err


def test_verify_accepts_a_good_checkpoint(root: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["verify", str(root)]) == 0
    assert "3 items, 16.1 KiB in" in capsys.readouterr().out


def test_verify_names_file_key_and_offset_of_a_flipped_byte(
        root: Path, capsys: pytest.CaptureFixture[str]):
    checkpoint = root / "step_3"
    (record,) = [r for r in read_manifest(str(checkpoint)).items if r.key == "model.w"]
    data_file = checkpoint / record.file
    with open(data_file, "r+b") as f:
        f.seek(record.offset + 100)
        byte = f.read(1)[0]
        f.seek(record.offset + 100)
        f.write(bytes([byte ^ 0x01]))

    assert main(["verify", str(root)]) == 1
    captured = capsys.readouterr()
    assert re.search(
        rf"^asynctron verify: item 'model\.w' in {re.escape(str(data_file))} at offset "
        rf"{record.offset}: expected xxh3_64 [0-9a-f]{{16}}, found [0-9a-f]{{16}}; the file "
        r"changed after commit$", captured.err, re.MULTILINE), captured.err
    assert "1 of 3 items corrupt" in captured.out


def test_verify_reports_a_truncated_file_as_corrupt(root: Path,
                                                    capsys: pytest.CaptureFixture[str]):
    checkpoint = root / "step_3"
    (record,) = [r for r in read_manifest(str(checkpoint)).items if r.key == "model.w"]
    os.truncate(checkpoint / record.file, record.offset + 10)
    assert main(["verify", str(root)]) == 1
    assert "'model.w'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_missing_checkpoint_exits_2(tmp_path: Path, command: str,
                                    capsys: pytest.CaptureFixture[str]):
    assert main([command, str(tmp_path / "nowhere")]) == 2
    assert "expected a committed checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_resumes_bit_identically_on_two_ranks(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]):
    """The main job at a tiny size: 2 ranks train, stop half-way, resume from the newest
    checkpoint (model, optimizer, loader position) and repeat the uninterrupted losses."""
    out_dir = tmp_path / "demo"
    argv = ["demo", "--out", str(out_dir), "--nproc", "2", "--steps", "8", "--save-every", "2",
            "--hidden", "32", "--layers", "1", "--seq-len", "16", "--batch", "2",
            "--keep-last", "2", "--nodes", "2", "--ranks-per-node", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("resume: bit-identical: steps 5-8 repeat the uninterrupted run's losses exactly on "
            "all 2 ranks") in out
    assert ("node 1 lost after step 5 (its ranks SIGKILLed, its local tier deleted); restarted "
            "on a fresh node: restored step 4") in out
    assert "(rank 0 from local; rank 1 from replica)" in out
    assert ("node loss: bit-identical: steps 5-8 repeat the uninterrupted 2-rank run's losses "
            "exactly on all 2 ranks") in out
    assert "first run (steps 1-4)" in out and "2 checkpoints" in out
    checkpoints = out_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_8"
    assert sorted(n for n in os.listdir(checkpoints) if n.startswith("step_")) == [
        "step_6", "step_8"]  # --keep-last 2


def test_demo_report_names_the_first_step_that_differs(tmp_path: Path) -> None:
    from asynctron._demo import DemoConfig, DemoReport, RunReport

    def run(name: str, first_step: int, losses: list[float]) -> RunReport:
        return RunReport(name, first_step, losses, 1.0, 0.0, 0.1, 0.0, 0.0, 0, 0, 0.0, 10)

    config = DemoConfig(out=str(tmp_path), num_steps=4, save_every=2)
    good = {"first": run("first", 1, [4.0, 3.0]), "resumed": run("resumed", 3, [2.5, 2.0]),
            "reference": run("reference", 1, [4.0, 3.0, 2.5, 2.0])}
    bad = dict(good, resumed=run("resumed", 3, [2.5, 2.0000001]))
    assert DemoReport(config, [good, good], 0.0, 0.0).mismatch is None
    assert DemoReport(config, [good, bad], 0.0, 0.0).mismatch == (
        "rank 1 step 4: expected loss 2.0 (uninterrupted), found 2.0000001 (resumed)")
    # the node-loss run: a lost rank has no first run; a survivor's goes past the restore
    lost = {"resumed": run("resumed", 3, [2.5, 2.0]), "reference": good["reference"]}
    survivor = dict(good, first=run("first", 1, [4.0, 3.0, 2.5]))
    assert DemoReport(config, [good], 0.0, 0.0, [survivor, lost]).mismatch is None
    early = dict(survivor, first=run("first", 1, [4.0, 3.5]))
    assert DemoReport(config, [good], 0.0, 0.0, [early, lost]).mismatch == (
        "node-loss run rank 0 step 2: expected loss 3.0 (uninterrupted), found 3.5 (first)")


def _stand_in_demo(passes: bool) -> types.FunctionType:
    """`run_demo` without training: 1 MiB of "checkpoints" in the output, a report that passes
    or not."""
    from asynctron._demo import DemoReport, RunReport

    def run(name: str, first_step: int, losses: list[float]) -> RunReport:
        return RunReport(name, first_step, losses, 1.0, 0.0, 0.1, 0.0, 0.0, 0, 0, 0.0, 10)

    def run_demo(config: Any) -> DemoReport:
        os.makedirs(os.path.join(config.out, "checkpoints"))
        with open(os.path.join(config.out, "checkpoints", "data"), "wb") as f:
            f.write(os.urandom(1 << 20))
        ranks = {"first": run("first", 1, [4.0, 3.0]),
                 "resumed": run("resumed", 3, [2.5, 2.0 if passes else 1.0]),
                 "reference": run("reference", 1, [4.0, 3.0, 2.5, 2.0])}
        return DemoReport(config, [ranks, ranks], 0.0, 0.0)

    return run_demo


@pytest.mark.parametrize("passes", [True, False])
def test_demo_removes_its_default_output_once_it_passes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        passes: bool) -> None:
    """Without --out, the demo writes under ./demo-out and says how much; a run that passes
    removes it (and ./demo-out, left empty), a failed one keeps it for a look."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("asynctron.cli.run_demo", _stand_in_demo(passes))
    assert main(["demo", "--steps", "4", "--save-every", "2", "--nodes", "0"]) == (
        0 if passes else 1)
    out = capsys.readouterr().out
    if passes:
        assert not (tmp_path / "demo-out").exists()
        assert re.search(r"\noutput: 1\.\d MiB in demo-out/\S+ \(corpus, checkpoints, tiers\), "
                         r"removed; --out DIR keeps it\n", out), out
    else:
        (kept,) = os.listdir(tmp_path / "demo-out")
        assert f"output: 1.0 MiB kept in demo-out/{kept}, for a look at the failed run" in out
    assert "event loop: worst delay 0.0 ms outside the steps' math" in out


def test_demo_keeps_the_out_dir_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("asynctron.cli.run_demo", _stand_in_demo(True))
    out_dir = tmp_path / "mine"
    assert main(["demo", "--out", str(out_dir), "--steps", "4", "--save-every", "2",
                 "--nodes", "0"]) == 0
    assert (out_dir / "checkpoints" / "data").exists()
    assert (f"output: 1.0 MiB in {out_dir}, kept (its checkpoints: `asynctron inspect "
            f"{out_dir / 'checkpoints'}`)") in capsys.readouterr().out


def test_demo_refuses_a_non_empty_out_dir_and_bad_settings(
        root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["demo", "--out", str(root), "--steps", "2", "--save-every", "1"]) == 2
    assert "expected a new or empty directory" in capsys.readouterr().err
    assert main(["demo", "--out", str(tmp_path / "d"), "--steps", "10", "--save-every",
                 "6"]) == 2
    assert "num_steps: expected at least 2 * save_every (12), found 10" in (
        capsys.readouterr().err)
    assert main(["demo", "--out", str(tmp_path / "e"), "--nodes", "1"]) == 2
    assert "num_nodes: expected 0 (no node-loss run) or an int >= 2, found 1" in (
        capsys.readouterr().err)


def test_a_stalled_store_names_the_deadline_flag(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The command's own `--deadline-s`, not `GcsConfig.deadline_s`; undone on return."""
    pytest.importorskip("aiohttp", reason="the gcs extra (aiohttp) is not installed")
    from asynctron.storage.backends.gcs import GcsBackend

    monkeypatch.delenv(STORE_DEADLINE_S, raising=False)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connects, never answers
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{silent.getsockname()[1]}")
        replaced = register_backend("gs", GcsBackend)  # made afresh, with this endpoint
        try:
            assert main(["verify", "--deadline-s", "0.5", "gs://bucket/run"]) == 2
        finally:
            register_backend("gs", replaced)
    err = capsys.readouterr().err
    assert re.search(r"answered none of this verify's requests for \d\.\d s .* right\? "
                     r"pass a larger --deadline-s to wait longer \(now 0\.5 s\)$", err), err
    assert STORE_DEADLINE_S not in os.environ
    assert store_deadline_hint("GcsConfig.deadline_s") == "GcsConfig.deadline_s"


def test_bench_forwards_the_remaining_args(monkeypatch: pytest.MonkeyPatch):
    calls: list[list[str]] = []

    def fake_main(argv: list[str] | None = None) -> int:
        calls.append(list(argv or []))
        return 7

    fake = types.ModuleType("asynctron.bench.save_throughput")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "asynctron.bench.save_throughput", fake)
    assert main(["bench", "save", "--size", "1MiB", "-h"]) == 7
    assert calls == [["--size", "1MiB", "-h"]]


def test_version_prints_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"asynctron {asynctron.__version__}\n"


def test_bench_help_says_what_each_scenario_measures(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in SCENARIOS:
        assert re.search(rf"^  {name} +\w.{{20,}}$", out, re.MULTILINE), name


_SECTIONS = ("usage:", "options:", "positional arguments:")


@pytest.mark.parametrize("argv", [[name] for name in sorted(SCENARIOS)] + [
    ["cuda", "--mode", "trainer"], ["cuda", "--mode", "load"], ["data", "--source", "s3"],
    ["save", "--nproc", "2"]], ids=" ".join)
def test_every_bench_help_reads_as_whole_sentences(argv: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The description is the module docstring's first paragraph, not its first line (which
    stopped mid-sentence: `... host-to-device load against a`), and cites no issue numbers."""
    try:
        status = main(["bench", *argv, "--help"])
    except SystemExit as exited:
        status = exited.code
    out, err = capsys.readouterr()
    if "which is not installed" in err:
        pytest.skip(err)
    assert status == 0, err
    prose = [" ".join(paragraph.split()) for paragraph in out.split("\n\n")
             if paragraph.strip() and not paragraph.startswith(_SECTIONS)]
    assert prose, out  # a description
    for paragraph in prose:
        assert re.search(r"[.!?][)`'\"]*$", paragraph), paragraph
    assert not re.search(r"\bissue \d", out), out


def test_bench_names_the_missing_peer_and_the_extra_that_installs_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "asynctron.bench.data_throughput", raising=False)
    assert main(["bench", "data"]) == 2
    err = capsys.readouterr().err
    assert "needs 'psutil', which is not installed" in err
    assert "pip install asynctron[bench]" in err


@pytest.mark.parametrize(("nbytes", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 << 20, "3.0 MiB"), (5 << 30, "5.0 GiB"),
])
def test_format_nbytes(nbytes: int, text: str):
    assert format_nbytes(nbytes) == text
