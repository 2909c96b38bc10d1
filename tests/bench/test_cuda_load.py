"""The GPU load benchmark on the CPU: every method reads its checkpoint bit-exactly, cold only
where pages can be evicted, and the ratios are the issue's. Structure only, never speed."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asynctron.bench import cuda_load


def _run(target: str, out: str, *extra: str) -> dict:
    assert cuda_load.main(["--device", "cpu", "--quick", "--target", target, "--out", out,
                           *extra]) == 0
    with open(out) as f:
        return json.load(f)


def test_a_cpu_run_reads_every_checkpoint_bit_exactly(tmp_path: object) -> None:
    result = _run(f"{tmp_path}/disk", f"{tmp_path}/load.json")
    assert result["bit_exact"] == {cuda_load.OURS: True, cuda_load.PLUGIN: True,
                                   cuda_load.STOCK: True}
    caches = ["warm"] if result["filesystem"] in ("tmpfs", "ramfs") else ["cold", "warm"]
    assert sorted(result["medians_s"]) == sorted(caches)
    for cache in caches:
        assert set(result["medians_s"][cache]) == set(cuda_load.METHODS)
        assert set(result["ratios"][cache]) == set(cuda_load.TARGETS)
        medians = result["medians_s"][cache]
        assert result["ratios"][cache]["plugin_vs_stock"] == pytest.approx(
            medians[cuda_load.STOCK] / medians[cuda_load.PLUGIN])
    assert result["num_tensors"] == 16
    assert os.listdir(f"{tmp_path}/disk") == []  # checkpoints removed


def test_on_tmpfs_only_warm_reads_are_measured(shm_path: str, tmp_path: object) -> None:
    if cuda_load.filesystem_type(shm_path) != "tmpfs":
        pytest.skip(f"{shm_path} is not a tmpfs here")
    result = _run(shm_path, f"{tmp_path}/load.json")
    assert list(result["medians_s"]) == ["warm"]
    assert result["notes"] == [f"cold reads: {shm_path} is tmpfs, its pages cannot be evicted"]


def test_the_filesystem_of_a_path_is_its_deepest_mount() -> None:
    assert cuda_load.filesystem_type("/proc/self") == "proc"
    assert cuda_load.filesystem_type("/") not in ("proc", "unknown")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tiny_gpu_run_reads_every_checkpoint_bit_exactly(shm_path: str,
                                                          tmp_path: object) -> None:
    out = f"{tmp_path}/load.json"
    assert cuda_load.main(["--quick", "--target", shm_path, "--out", out]) == 0
    with open(out) as f:
        result = json.load(f)
    assert all(result["bit_exact"].values()) and result["device"] != "cpu"
