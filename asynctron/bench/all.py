"""Every benchmark of the engine in one command: save (one process and across 2 and 4 ranks),
datasets, comm (idle and beside a GIL-busy, a dispatch-like or a torch-busy thread), the
write sweep, CUDA staging where there is a GPU, saves and data inside a busy trainer, many
small tensors, hostile checkpoint metadata, stock DCP through asynctron's plugin,
checkpoints and datasets on a local S3 server, and tiered checkpoints (local tiers on the disk
and in memory, a local S3 server as the store).
Each scenario runs in its own process (fresh memory), writing JSON into one results directory
(a source checkout's `bench/report.py` renders `docs/benchmarks.md` from it).

Run: `asynctron bench all --results DIR` (or `python -m asynctron.bench.all`); `--quick` for a
smoke run with tiny sizes.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

from asynctron.bench._results import DEFAULT_RESULTS_DIR, description


@dataclass(frozen=True, slots=True)
class Run:
    """One scenario of the full run: its module, its arguments (`{disk}`: a scratch directory on
    the disk under test) and the JSON file it writes in the results directory."""

    module: str
    args: tuple[str, ...]
    result_file: str


RUNS = {
    "save": Run("save_throughput", ("--targets", "/dev/shm,{disk}"), "save.json"),
    "save_ranks2": Run("save_ranks", ("--nproc", "2", "--target", "{disk}"), "save_ranks2.json"),
    "save_ranks4": Run("save_ranks", ("--nproc", "4", "--target", "{disk}"), "save_ranks4.json"),
    "data": Run("data_throughput", ("--dir", "{disk}"), "data.json"),
    "comm": Run("allreduce_overlap", (), "comm.json"),
    "comm_busy": Run("allreduce_overlap",
                     ("--trainer", "python", "--models", "10M", "--bucket-mb", "25"),
                     "comm_busy.json"),
    "comm_dispatch": Run("allreduce_overlap",
                         ("--trainer", "dispatch", "--models", "10M", "--bucket-mb", "25"),
                         "comm_dispatch.json"),
    "comm_torch": Run("allreduce_overlap",
                      ("--trainer", "torch", "--models", "10M", "--bucket-mb", "25"),
                      "comm_torch.json"),
    "write": Run("write_sweep", ("--target", "{disk}"), "write.json"),
    "cuda": Run("cuda_staging", (), "cuda.json"),
    "train": Run("train", (), "train.json"),
    "many": Run("save_many", (), "many.json"),
    "train_data": Run("train_data", ("--dir", "{disk}"), "train_data.json"),
    "hostile": Run("hostile_metadata", ("--dir", "{disk}"), "hostile.json"),
    "dcp": Run("dcp_plugin", ("--target", "/dev/shm", "--target", "{disk}"), "dcp.json"),
    "s3": Run("s3", ("--size-gib", "0.25", "--repeats", "2", "--dir", "{disk}"), "s3.json"),
    "data_s3": Run("data_s3", ("--source", "s3", "--corpus-mib", "512", "--megatron-limit-s",
                               "20", "--repeats", "2", "--dir", "{disk}"), "data_s3.json"),
    "s3_restarts": Run("s3", ("--ranks", "8", "--size-gib", "1", "--repeats", "3"),
                       "s3_restarts.json"),
    "tiers": Run("tiers", ("--target", "{disk}"), "tiers.json"),
    "tiers_shm": Run("tiers", ("--target", "/dev/shm"), "tiers_shm.json"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench all",
                                     description=description(__doc__))
    parser.add_argument("--only", default=",".join(RUNS),
                        help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--disk", default=os.path.join(os.getcwd(), ".benchtmp"),
                        help="scratch directory on the disk to test")
    parser.add_argument("--results", default=None,
                        help="directory for the JSON results (default: "
                             "./asynctron-bench/all_<host>_<yyyymmdd>)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"--only: expected names from {sorted(RUNS)}, found {unknown}")
    results = args.results or os.path.join(
        DEFAULT_RESULTS_DIR, f"all_{platform.node()}_{time.strftime('%Y%m%d')}")
    os.makedirs(results, exist_ok=True)
    os.makedirs(args.disk, exist_ok=True)
    failed = []
    for index, name in enumerate(names, start=1):
        run = RUNS[name]
        command = [sys.executable, "-m", f"asynctron.bench.{run.module}",
                   *(arg.format(disk=args.disk) for arg in run.args),
                   "--out", os.path.join(results, run.result_file)]
        if args.quick and name != "cuda":
            command.append("--quick")
        print(f"[{index}/{len(names)}] {name}: {' '.join(command[2:])}", flush=True)
        started = time.perf_counter()
        if subprocess.run(command).returncode != 0:
            failed.append(name)
        print(f"[{index}/{len(names)}] {name}: done in {time.perf_counter() - started:.0f} s",
              flush=True)
    print(f"results: {results}")
    if failed:
        print(f"asynctron bench all: {failed} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
