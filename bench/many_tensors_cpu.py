"""CPU proxies of issue 30's many-tensor GPU paths, for a machine without a GPU: the same code
CUDA tensors take, its cost per tensor measured on CPU tensors.

- staging through the tensor path (CUDA's: every tensor's address hidden, so each is copied
  by `torch._foreach_copy_` from views, not memcpy'd), `SaveResult.stage_s`;
- `Engine.load_into` strided CPU targets (every other row of a taller tensor), and `dcp.load`
  through `asynctron.dcp.StorageReader` into the same: both through slabs, as CUDA targets
  are.
256 MiB in N tensors (160, 2,590, 10,000), on /dev/shm, medians of 5 after a warm-up.

Run: `python -m bench.many_tensors_cpu` (from the repo root). To compare with another tree,
`PYTHONPATH=<that tree> python bench/many_tensors_cpu.py`.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import uvloop

from asynctron import Engine
from asynctron.dcp import StorageReader, StorageWriter
from asynctron.engine import _staging

MiB = 1 << 20
COUNTS = (160, 2590, 10_000)


def _strided_targets(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every other row of a tensor twice as tall: not contiguous (so filled through slabs),
    yet copied row by row, so the copies are cheap and what each tensor costs shows."""
    return {key: torch.zeros(2 * value.shape[0], value.shape[1])[::2]
            for key, value in state.items()}


def _median_after_warmup(run: Callable[[], float], rounds: int = 6) -> float:
    return statistics.median([run() for _ in range(rounds)][1:])


async def _engine_paths(flat: dict[str, torch.Tensor], square: dict[str, torch.Tensor],
                        root: str) -> dict[str, float]:
    times: dict[str, list[float]] = {"stage (tensor path)": [], "load_into strided": []}
    real = _staging._address
    async with Engine(memory_budget_bytes=512 * MiB, checksum=None) as engine:
        _staging._address = lambda p: 0 if isinstance(p, torch.Tensor) else real(p)
        try:
            for round_index in range(6):
                result = await engine.save(flat, f"{root}/flat{round_index}")
                times["stage (tensor path)"].append(result.stage_s)
                shutil.rmtree(f"{root}/flat{round_index}")
        finally:
            _staging._address = real
        await engine.save(square, f"{root}/square")
        target = _strided_targets(square)
        for _ in range(6):
            start = time.perf_counter()
            await engine.load_into(target, f"{root}/square")
            times["load_into strided"].append(time.perf_counter() - start)
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def _dcp_path(square: dict[str, torch.Tensor], root: str) -> float:
    dcp.save(square, storage_writer=StorageWriter(f"{root}/dcp", checksum=None))
    target = _strided_targets(square)

    def load() -> float:
        start = time.perf_counter()
        dcp.load(target, storage_reader=StorageReader(f"{root}/dcp"))
        return time.perf_counter() - start

    return _median_after_warmup(load)


def measure(count: int) -> dict[str, Any]:
    side = max(1, int((256 * MiB // count // 4) ** 0.5))
    flat = {f"t{i}": torch.randn(side * side) for i in range(count)}
    square = {f"t{i}": torch.randn(side, side + 1) for i in range(count)}
    root = tempfile.mkdtemp(prefix="asynctron-many-tensors-", dir="/dev/shm")
    try:
        figures = uvloop.run(_engine_paths(flat, square, root))
        with warnings.catch_warnings():  # one-rank DCP without a process group says so
            warnings.simplefilter("ignore", UserWarning)
            figures["dcp.load strided"] = _dcp_path(square, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return figures


def main() -> None:
    print("| tensors | " + " | ".join(["stage (tensor path)", "load_into strided",
                                       "dcp.load strided"]) + " |")
    print("| ---: | ---: | ---: | ---: |")
    for count in COUNTS:
        figures = measure(count)
        print(f"| {count:,} | " + " | ".join(f"{seconds * 1e3:.0f} ms"
                                             for seconds in figures.values()) + " |",
              flush=True)


if __name__ == "__main__":
    main()
