"""Smoke test: the CUDA staging benchmark runs at a tiny size (GPU only) and says so without."""

from __future__ import annotations

import json

import pytest
import torch

from asynctron.bench import cuda_staging


def test_without_cuda_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real run below covers it")
    assert cuda_staging.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_run_reports_both_ratios(shm_path: str, tmp_path: object) -> None:
    out = f"{tmp_path}/cuda.json"
    assert cuda_staging.main(["--size-gib", "0.05", "--repeats", "1", "--target", shm_path,
                              "--out", out]) == 0
    with open(out) as f:
        result = json.load(f)
    assert result["d2h_vs_raw"] > 0 and result["h2d_vs_raw"] > 0
