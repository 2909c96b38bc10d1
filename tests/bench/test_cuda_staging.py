"""Smoke test: the CUDA staging benchmark runs at a tiny size (GPU only) and says so without;
its state layouts (mixed sizes, or N tensors) and the dispatch of `asynctron bench cuda --mode`."""

from __future__ import annotations

import json

import pytest
import torch

from asynctron.bench import cuda_staging
from asynctron.bench.cuda_staging import tensor_sizes

GiB = 1 << 30
MiB = 1 << 20
no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="a GPU is present: the real runs cover it")


@no_cuda
@pytest.mark.parametrize("mode", ["staging", "trainer", "load"])
def test_without_cuda_every_mode_says_so(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cuda_staging.main(["--mode", mode]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_the_mixed_layout_is_the_issues_2590_tensors_in_4_gib() -> None:
    sizes = tensor_sizes(4 * GiB)
    assert len(sizes) == 2590 and sum(sizes) == 4 * GiB
    assert max(sizes) == 256 * MiB and min(sizes) == MiB


@pytest.mark.parametrize("count", [1, 2, 160, 2590])
def test_n_tensors_sum_to_the_size_over_a_256x_range(count: int) -> None:
    sizes = tensor_sizes(4 * GiB + 3, count)
    assert len(sizes) == count and sum(sizes) == 4 * GiB
    assert all(size > 0 and size % 4 == 0 for size in sizes)
    if count > 2:
        assert 200 < sizes[-1] / sizes[0] < 300


def test_more_tensors_than_floats_is_refused() -> None:
    with pytest.raises(ValueError, match=r"num_tensors: expected 1 to 2 for 8 bytes, found 3"):
        tensor_sizes(8, 3)


def test_the_state_has_the_layout_on_the_device() -> None:
    state = cuda_staging.make_state(MiB, torch.device("cpu"), 16)
    assert len(state) == 16 and sum(t.nbytes for t in state.values()) == MiB
    assert all(t.dtype == torch.float32 for t in state.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tensors", [[], ["--tensors", "160"]])
def test_tiny_run_reports_both_ratios(shm_path: str, tmp_path: object,
                                      tensors: list[str]) -> None:
    out = f"{tmp_path}/cuda.json"
    assert cuda_staging.main(["--size-gib", "0.05", "--repeats", "1", "--target", shm_path,
                              "--out", out, *tensors]) == 0
    with open(out) as f:
        result = json.load(f)
    assert result["d2h_vs_raw"] > 0 and result["h2d_vs_raw"] > 0
    assert result["num_tensors"] == (160 if tensors else len(tensor_sizes(int(0.05 * GiB))))
