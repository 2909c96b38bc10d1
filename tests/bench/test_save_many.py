"""Smoke test: the many-small-tensors benchmark runs at a tiny size. Structure only."""

from __future__ import annotations

import json

import pytest

from asynctron.cli import main


@pytest.mark.slow
def test_quick_run_compares_with_torch_save(shm_path: str, tmp_path: object) -> None:
    out = f"{tmp_path}/many.json"
    assert main(["bench", "many", "--quick", "--target", shm_path, "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    assert {"asynctron (warm engine)", "asynctron (first save, fresh Engine)", "torch.save",
            "safetensors", "load: asynctron", "load: torch.load"} <= set(results["medians_s"])
    assert len(results["loop_worst_delay_s"]["asynctron (warm engine)"]) == 1
