"""CUDA staging benchmark: asynctron's device-to-host staging and host-to-device load against a
raw pinned `copy_` of the same tensors, in one process (needs a GPU; exits 0 saying so without).

- D2H: `await task.staged` of `engine.save(gpu_state, ...)` (copies on the engine's copy stream
  into pinned slabs, hashed as they land) against a raw loop of `pinned.copy_(t,
  non_blocking=True)` into preallocated pinned buffers plus one synchronize. Target: asynctron
  >= 0.9x the raw bandwidth, for ~160 tensors and for 2,590 (issue 30).
- H2D: `engine.load_into(gpu_state, path)` from /dev/shm against a raw pinned->device copy.

The state is mixed sizes (1 to 256 MiB tensors: 2,590 of them in 4 GiB), or `--tensors N`
tensors whose sizes run geometrically over a 256x range. Other modes of `asynctron bench cuda`:
`--mode trainer` (a GPU trainer checkpointing every N steps against DCP and Megatron:
`asynctron.bench.cuda_trainer`) and `--mode load` (GPU loads against stock `dcp.load` and raw
pread + H2D: `asynctron.bench.cuda_load`).

Run: `python -m asynctron.bench.cuda_staging` (or `asynctron bench cuda`).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import time

import torch
import uvloop

from asynctron import Engine
from asynctron.bench import _results

GiB = 1 << 30
MiB = 1 << 20
#: `--mode` -> the module whose `main(argv)` runs it (`None`: this one)
MODES = {"staging": None, "trainer": "cuda_trainer", "load": "cuda_load"}
#: D2H staging / raw pinned copy_ (issue 30)
D2H_TARGET = 0.9


def tensor_sizes(total_bytes: int, num_tensors: int | None = None) -> list[int]:
    """Byte sizes (multiples of 4: float32 tensors) summing to `total_bytes` rounded down to 4.

    Without `num_tensors`: mixed sizes as a model's parameters and optimizer state are, 256 MiB
    tensors halving every third one down to 1 MiB, then 1 MiB ones (2,590 tensors in 4 GiB).
    With it: exactly `num_tensors` sizes growing geometrically over a 256x range.
    """
    total_bytes -= total_bytes % 4
    if num_tensors is None:
        sizes, left, size = [], total_bytes, 256 * MiB
        while left > 0:
            sizes.append(min(size, left))
            left -= sizes[-1]
            size = max(MiB, size // 2) if len(sizes) % 3 == 0 else size
        return sizes
    if not 0 < num_tensors <= total_bytes // 4:
        raise ValueError(f"num_tensors: expected 1 to {total_bytes // 4} for {total_bytes} "
                         f"bytes, found {num_tensors}")
    ratio = 256 ** (1 / (num_tensors - 1)) if num_tensors > 1 else 1.0
    weights = [ratio ** i for i in range(num_tensors)]
    scale = total_bytes / 4 / sum(weights)
    sizes = [max(1, int(w * scale)) * 4 for w in weights]
    sizes[-1] += total_bytes - sum(sizes)  # the largest absorbs the rounding
    return sizes


def make_state(total_bytes: int, device: torch.device, num_tensors: int | None = None
               ) -> dict[str, torch.Tensor]:
    """Random float32 tensors of `tensor_sizes(total_bytes, num_tensors)` on `device`."""
    return {f"t{i}": torch.randn(n // 4, device=device)
            for i, n in enumerate(tensor_sizes(total_bytes, num_tensors))}


def raw_d2h(state: dict[str, torch.Tensor], pinned: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for tensor, host in zip(state.values(), pinned, strict=True):
        host.copy_(tensor, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def raw_h2d(state: dict[str, torch.Tensor], pinned: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for tensor, host in zip(state.values(), pinned, strict=True):
        tensor.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """`asynctron bench cuda [--mode staging|trainer|load] ...`: the staging benchmark here,
    the other modes in their own modules (their `--help` lists their options)."""
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--mode", choices=sorted(MODES), default="staging")
    chosen, rest = chooser.parse_known_args(argv)
    if MODES[chosen.mode] is not None:
        module = importlib.import_module(f"asynctron.bench.{MODES[chosen.mode]}")
        return module.main(rest)
    parser = argparse.ArgumentParser(prog="asynctron bench cuda",
                                     description=_results.description(__doc__))
    parser.add_argument("--mode", choices=sorted(MODES), default="staging",
                        help="staging (this), trainer or load (see their --help)")
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=None,
                        help="number of tensors (default: mixed 1-256 MiB sizes)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target", default="/dev/shm")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("asynctron bench cuda: no CUDA device; nothing to measure")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    state = make_state(int(args.size_gib * GiB), device, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pinned = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True)
              .view(t.dtype).view(t.shape) for t in state.values()]
    started = time.time()
    base = _results.scratch_dir("asynctron-cuda-bench-", args.target)
    timings: dict[str, list[float]] = {}

    async def run() -> None:
        budget = (nbytes + 64 * MiB) // (64 * MiB) * (64 * MiB)
        async with Engine(memory_budget_bytes=budget, pin_memory=True) as engine:
            for round_index in range(args.repeats + 1):
                path = f"{base}/step_{round_index}"
                d2h = raw_d2h(state, pinned)
                task = engine.save(state, path)
                await task.staged
                result = await task
                h2d = raw_h2d(state, pinned)
                torch.cuda.synchronize()
                start = time.perf_counter()
                await engine.load_into(state, path)
                load_s = time.perf_counter() - start
                shutil.rmtree(path)
                if round_index:  # round 0 warms slabs, streams and the page cache
                    for name, value in (("raw pinned D2H", d2h),
                                        ("asynctron staging", result.stage_s),
                                        ("raw pinned H2D", h2d),
                                        ("asynctron load into GPU", load_s),
                                        ("asynctron save total", result.total_s)):
                        timings.setdefault(name, []).append(value)

    try:
        uvloop.run(run())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    print(f"{torch.cuda.get_device_name(device)}: {nbytes / GiB:.2f} GiB in {len(state)} "
          "tensors")
    for name, median in medians.items():
        print(f"{name:<28}{median:>9.3f} s{nbytes / median / 1e9:>8.2f} GB/s")
    d2h_ratio = medians["raw pinned D2H"] / medians["asynctron staging"]
    h2d_ratio = medians["raw pinned H2D"] / medians["asynctron load into GPU"]
    print(f"D2H staging vs raw pinned copy_: {d2h_ratio:.2f}x (target >= {D2H_TARGET}x)")
    print(f"load into GPU (from {args.target}) vs raw pinned H2D: {h2d_ratio:.2f}x")
    _results.write_results("cuda_staging", {
        "device": torch.cuda.get_device_name(device), "nbytes": nbytes,
        "num_tensors": len(state), "timings_s": timings, "medians_s": medians,
        "d2h_vs_raw": d2h_ratio, "h2d_vs_raw": h2d_ratio,
        "meta": _results.run_meta(started, args, torch=torch.__version__)},
        out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
