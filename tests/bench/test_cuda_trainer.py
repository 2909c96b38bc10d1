"""The GPU trainer benchmark's loop, sums and arguments on the CPU: when the trainer waits for a
save (staged before the next optimizer step, a previous save before the next request), which
steps count as "with a save in flight", the ratios against DCP's best, and a CPU run of the
whole benchmark with a tiny model. Structure only, never speed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from asynctron.bench import _peers, _savers, cuda_trainer
from asynctron.bench.cuda_trainer import Run, SaveTiming, Step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Loss:
    def __init__(self, events: list[str]) -> None:
        self._events = events

    def item(self) -> float:
        self._events.append("item")
        return 0.0


class FakeTrainer:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def forward_backward(self) -> _Loss:
        self.events.append("fwd_bwd")
        return _Loss(self.events)

    def optimizer_step(self) -> None:
        self.events.append("opt")

    def state(self) -> dict[str, Any]:
        return {"w": torch.zeros(1)}


class FakeHandle(_savers.SaveHandle):
    def __init__(self, name: str, events: list[str], *, done: bool) -> None:
        super().__init__(requested=0.0)
        self.name, self.events, self._done = name, events, done

    async def wait_staged(self) -> None:
        self.events.append(f"staged {self.name}")

    def done(self) -> bool:
        return self._done

    async def wait_durable(self) -> None:
        self.events.append(f"durable {self.name}")
        self._done = True
        self.staged_s, self.durable_s = 0.1, 0.2


class FakeSaver(_savers.Saver):
    name = "fake"

    def __init__(self, events: list[str], *, done: bool) -> None:
        self.events, self.done = events, done

    async def start(self, state: dict[str, Any], path: str) -> _savers.SaveHandle:
        name = os.path.basename(path)
        self.events.append(f"save {name}")
        return FakeHandle(name, self.events, done=self.done)


async def _events(wait_staged: str, *, done: bool) -> tuple[list[str], Run]:
    events: list[str] = []
    run = await cuda_trainer.train_with_saves(
        FakeTrainer(events), FakeSaver(events, done=done), "/nowhere", steps_alone=1,
        save_every=2, num_saves=2, wait_staged=wait_staged)
    return events, run


async def test_staged_is_awaited_before_the_next_optimizer_step() -> None:
    """Invariant: the save is requested after a step's `loss.item()`; the trainer waits for it to
    be staged only after the next forward and backward, before that step's optimizer step; the
    warm-up save is waited for to the end first; a save whose predecessor is durable does not
    wait for it."""
    events, run = await _events("before_step", done=True)
    assert events == [
        "fwd_bwd", "opt", "item",  # alone
        "save warm_up", "staged warm_up", "durable warm_up",
        "fwd_bwd", "opt", "item", "fwd_bwd", "opt", "item", "save step_1",
        "fwd_bwd", "staged step_1", "opt", "item", "fwd_bwd", "opt", "item", "save step_3",
        "fwd_bwd", "staged step_3", "opt", "item", "fwd_bwd", "opt", "item",
        "durable step_1", "durable step_3"]
    assert len(run.steps_alone) == 1 and len(run.steps_saving) == 6 and len(run.saves) == 2
    assert all(s.durable_s == 0.2 and s.staged_s == 0.1 for s in run.saves)


async def test_at_once_waits_right_after_the_request_and_a_save_waits_for_the_last() -> None:
    events, run = await _events("at_once", done=False)
    first = events.index("save step_1")
    assert events[first:first + 2] == ["save step_1", "staged step_1"]
    second = events.index("save step_3")
    assert events[second - 1] == "durable step_1"  # the previous save was still in flight
    assert run.saves[0].previous_wait_s == 0.0 and run.saves[1].previous_wait_s >= 0.0


def _step(start: float, end: float, stall: float = 0.0) -> Step:
    return Step(start, end, stall)


def test_steps_overlapping_a_save_are_in_flight_with_stalls_left_out() -> None:
    run = Run(steps_alone=[_step(0, 1), _step(1, 2), _step(2, 3)],
              steps_saving=[_step(10, 11), _step(11, 13, stall=1.0), _step(13, 15),
                            _step(20, 21)],
              saves=[SaveTiming(requested=11.0, blocking_s=1.5, staged_s=1.2, durable_s=3.0)])
    m = cuda_trainer.summarize_run(run)
    assert m["step_alone_s"] == 1.0
    assert m["samples"]["step_in_flight_s"] == [1.0, 2.0]  # 11..13 less its stall, 13..15
    assert m["num_steps_in_flight"] == 2 and m["num_steps_between_saves"] == 2
    assert m["step_in_flight_s"] == 1.5 and m["step_ratio"] == 1.5
    assert (m["blocking_s"], m["staged_s"], m["durable_s"]) == (1.5, 1.2, 3.0)


def _method(blocking: float, staged: float = 1.0, durable: float = 2.0,
            step_ratio: float = 1.0) -> dict[str, float]:
    return {"blocking_s": blocking, "staged_s": staged, "durable_s": durable,
            "step_ratio": step_ratio}


def test_ratios_are_against_the_zoc_saver_that_blocks_least() -> None:
    ratios = cuda_trainer.ratios({
        _savers.OURS: _method(0.1, durable=1.0, step_ratio=1.01),
        _savers.ZOC_THREAD: _method(0.4),
        _savers.ZOC_PROCESS: _method(0.2, durable=4.0),
        _savers.DCP_DEFAULT: _method(0.01)})  # not a zoc saver: never the reference
    assert ratios["best_zoc"] == _savers.ZOC_PROCESS
    assert ratios[_savers.OURS]["blocking_vs_best_zoc"] == pytest.approx(0.5)
    assert ratios[_savers.OURS]["durable_vs_best_zoc"] == pytest.approx(0.25)
    assert ratios[_savers.OURS]["step_ratio"] == 1.01
    assert _savers.OURS_BACKGROUND not in ratios


def test_without_a_zoc_saver_the_ratios_are_not_numbers() -> None:
    ratios = cuda_trainer.ratios({_savers.OURS: _method(0.1)})
    assert ratios["best_zoc"] is None
    assert math.isnan(ratios[_savers.OURS]["blocking_vs_best_zoc"])


def test_quick_shrinks_the_model_and_unknown_methods_are_named(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = cuda_trainer.parse_args(["--quick"])
    assert (args.hidden, args.layers, args.saves) == (64, 2, 1)
    assert args.methods == list(_savers.NAMES)
    assert 350e6 < cuda_trainer.FULL_MODEL.num_parameters < 450e6
    with pytest.raises(SystemExit):
        cuda_trainer.parse_args(["--methods", "asynctron,nccl magic"])
    assert "found ['nccl magic']" in capsys.readouterr().err


def test_the_model_has_the_parameters_it_says() -> None:
    config = cuda_trainer.ModelConfig(hidden=64, num_layers=2, vocab_size=256,
                                      sequence_length=32, micro_batch_size=2)
    trainer = cuda_trainer.Trainer(config, torch.device("cpu"))
    assert sum(p.numel() for p in trainer.model.parameters()) == config.num_parameters


def test_a_cpu_run_measures_savers_without_a_process_group(tmp_path: object) -> None:
    out = f"{tmp_path}/trainer.json"
    methods = ",".join([_savers.OURS, _savers.OURS_BACKGROUND, _savers.ZOC_THREAD,
                        _savers.DCP_DEFAULT])
    assert cuda_trainer.main(["--device", "cpu", "--quick", "--methods", methods,
                              "--target", f"{tmp_path}/ckpt", "--out", out]) == 0
    with open(out) as f:
        result = json.load(f)
    assert list(result["methods"]) == [_savers.OURS, _savers.ZOC_THREAD,
                                       _savers.OURS_BACKGROUND, _savers.DCP_DEFAULT]
    for m in result["methods"].values():
        assert m["blocking_s"] >= 0 and 0 < m["staged_s"] <= m["durable_s"]
        assert m["step_alone_s"] > 0 and m["num_steps_in_flight"] >= 1
    assert result["ratios"]["best_zoc"] == _savers.ZOC_THREAD
    assert result["options"][_savers.ZOC_THREAD] == {
        "use_pinned_memory": False, "use_shared_memory": True, "use_async_staging": True,
        "use_non_blocking_copy": False,
        "stager_kept_across_saves": _peers.default_stager_is_reusable()}
    assert os.listdir(f"{tmp_path}/ckpt") == []  # checkpoints removed


@pytest.mark.slow
def test_a_cpu_run_measures_every_saver(tmp_path: object) -> None:
    """In a process of its own: DCP's process mode needs a process group, which would outlive
    the test in this one."""
    out = f"{tmp_path}/trainer.json"
    subprocess.run([sys.executable, "-m", "asynctron.bench.cuda_trainer", "--device", "cpu",
                    "--quick", "--target", f"{tmp_path}/ckpt", "--out", out], cwd=ROOT,
                   check=True, timeout=600, capture_output=True)
    with open(out) as f:
        result = json.load(f)
    ran = set(result["methods"]) | set(result["not_run"])
    assert ran == set(_savers.NAMES)
    assert _savers.ZOC_PROCESS in result["methods"]
    assert set(result["not_run"]) <= {_savers.MEGATRON}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tiny_gpu_run_measures_asynctron_and_dcp_zoc(tmp_path: object) -> None:
    out = f"{tmp_path}/trainer.json"
    methods = ",".join([_savers.OURS, _savers.OURS_BACKGROUND, _savers.ZOC_THREAD])
    assert cuda_trainer.main(["--quick", "--methods", methods, "--target", f"{tmp_path}/ckpt",
                              "--out", out]) == 0
    with open(out) as f:
        result = json.load(f)
    assert set(result["methods"]) == {_savers.OURS, _savers.OURS_BACKGROUND,
                                      _savers.ZOC_THREAD}
    assert result["options"][_savers.ZOC_THREAD]["use_pinned_memory"] is True
