"""Every benchmark of the engine in one command, then the report: save (one process and across
2 and 4 ranks), datasets, comm (idle and beside a GIL-busy thread), the write sweep, CUDA
staging where there is a GPU, saves and data inside a busy trainer, many small tensors, and
hostile checkpoint metadata. Each scenario runs in its own process (fresh memory), writing JSON
into one results directory;
`bench/report.py` then renders `docs/benchmarks.md` and its plots from it.

Run: `python -m bench.all` (or `asynctron bench all`); `--quick` for a smoke run (tiny sizes;
its report goes beside its results unless `--docs` says otherwise).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

from bench import report

#: scenario -> the module and its arguments (`{disk}`: a scratch directory on the disk)
RUNS = {
    "save": ("bench.save_throughput", ["--targets", "/dev/shm,{disk}"]),
    "save_ranks2": ("bench.save_ranks", ["--nproc", "2", "--target", "{disk}"]),
    "save_ranks4": ("bench.save_ranks", ["--nproc", "4", "--target", "{disk}"]),
    "data": ("bench.data_throughput", ["--dir", "{disk}"]),
    "comm": ("bench.allreduce_overlap", []),
    "comm_busy": ("bench.allreduce_overlap",
                  ["--trainer", "python", "--models", "10M", "--bucket-mb", "25"]),
    "write": ("bench.write_sweep", ["--target", "{disk}"]),
    "cuda": ("bench.cuda_staging", []),
    "train": ("bench.train", []),
    "many": ("bench.save_many", []),
    "train_data": ("bench.train_data", ["--dir", "{disk}"]),
    "hostile": ("bench.hostile_metadata", ["--dir", "{disk}"]),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench all",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--only", default=",".join(RUNS),
                        help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--disk", default=os.path.join(os.getcwd(), ".benchtmp"),
                        help="scratch directory on the disk to test")
    parser.add_argument("--results", default=None, help="directory for the JSON results")
    parser.add_argument("--docs", default=None, help="where benchmarks.md and its plots go "
                                                     "(default: docs/, or --results if --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"--only: expected names from {sorted(RUNS)}, found {unknown}")
    results = args.results or os.path.join(
        os.path.dirname(__file__), "results", f"all_{platform.node()}_{time.strftime('%Y%m%d')}")
    docs = args.docs or (results if args.quick else "docs")
    os.makedirs(results, exist_ok=True)
    os.makedirs(args.disk, exist_ok=True)
    failed = []
    for index, name in enumerate(names, start=1):
        module, extra = RUNS[name]
        command = [sys.executable, "-m", module,
                   *(arg.format(disk=args.disk) for arg in extra),
                   "--out", os.path.join(results, report.SCENARIOS[name][0])]
        if args.quick and name != "cuda":
            command.append("--quick")
        print(f"[{index}/{len(names)}] {name}: {' '.join(command[2:])}", flush=True)
        started = time.perf_counter()
        if subprocess.run(command).returncode != 0:
            failed.append(name)
        print(f"[{index}/{len(names)}] {name}: done in {time.perf_counter() - started:.0f} s",
              flush=True)
    print(f"report: {report.render(results, docs)}")
    if failed:
        print(f"asynctron bench all: {failed} failed; their sections say 'Not run'",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
