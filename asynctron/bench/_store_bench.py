"""The run `asynctron bench azure` and `asynctron bench gcs` share: the store's own server
started for the run, every method in a fresh process per round with a room (container, bucket)
of its own, and bench.s3's medians, ratios and table, with the server's CPU seconds per GB and
the target over the raw client. A store's module says what differs in one `StoreBench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from asynctron.bench import _baselines, _results, _s3_report
from asynctron.bench._rounds import round_order
from asynctron.bench._s3_methods import (
    OURS,
    GiB,
    Job,
    MiB,
)

TARGET_OVER_RAW = 0.9
"""The issue's target: asynctron's save and load throughput over the raw client's, at least."""


class Rooms(Protocol):
    """Makes and removes the fresh container or bucket each run writes into."""

    def create(self, name: str) -> None: ...

    def delete(self, name: str) -> None: ...


class Server(Protocol):
    """A store's local server, as the `asynctron.testing` ones are."""

    process: Any

    def environment(self) -> dict[str, str]: ...

    def stop(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class StoreBench:
    """One store's benchmark: its methods and what they need, its server and its rooms."""

    name: str
    """The command's name (`asynctron bench NAME`) and its results'."""
    title: str
    server_name: str
    server_description: str
    scheme: str
    methods: tuple[str, ...]
    raw: str
    peers: tuple[str, ...]
    needs: Mapping[str, tuple[str, str]]
    """Per method: the module it imports, and how to install it."""
    distributions: tuple[str, ...]
    """Whose versions the results record."""
    run_rank: Callable[[int, int, Job], dict[str, Any]]
    """A rank's run of a job (module-level: it is pickled)."""
    start_server: Callable[[str], Server]
    """Starts the server, its files under the given folder."""
    rooms: Callable[[Server], AbstractContextManager[Rooms]]
    server_versions: Callable[[], dict[str, str]]
    rank_environment: Mapping[str, str] = field(default_factory=dict)
    """Set for the ranks beside the server's own settings."""
    quick_part_mib: int = 1
    also_over: tuple[str, ...] = ()
    """Methods asynctron's ratios are also given over (beside the raw one's)."""
    named_only: tuple[str, ...] = ()
    """Methods run only where `--only` names them (the slow ones)."""
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    job_for: Callable[[Job, argparse.Namespace], Job] = lambda job, args: job
    """The job a method runs, from the common one (a store's own settings added)."""


def unavailable(bench: StoreBench, method: str) -> str | None:
    """Why `method` cannot run here (a missing client, peer or backend), or None."""
    module, hint = bench.needs[method]
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"{module} is not importable ({type(error).__name__}: {error}); {hint}"
    return None


def cpu_s_of(pid: int) -> float:
    """A process's CPU time so far (user and system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_rounds(bench: StoreBench, server: Server, methods: list[str],
               args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every method in a fresh process each round (round 0 untimed, but with `--quick`), each
    in a fresh room deleted after; per method, each timed round's results."""
    from asynctron._launch import run_local_ranks

    state_bytes = int(args.size_gib * GiB)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
    with bench.rooms(server) as rooms:
        for round_index in range(int(args.quick), args.repeats + 1):
            for name in round_order(methods, round_index):
                room = f"bench-{round_index}-{bench.methods.index(name)}"
                rooms.create(room)
                job = bench.job_for(Job(
                    method=name, url=f"{bench.scheme}://{room}/run", state_bytes=state_bytes,
                    warmup_bytes=min(16 * MiB, max(MiB, state_bytes // 8)),
                    part_bytes=args.part_mib * MiB, num_requests=args.requests,
                    num_threads=args.threads), args)
                started, server_cpu = time.perf_counter(), cpu_s_of(server.process.pid)
                try:
                    (outcome,) = run_local_ranks(bench.run_rank, 1, job,
                                                 timeout_s=300 + state_bytes / 2e6)
                    server_cpu = cpu_s_of(server.process.pid) - server_cpu
                finally:
                    rooms.delete(room)
                if outcome.failed:
                    raise RuntimeError(f"{name}: its process failed (exit code "
                                       f"{outcome.exitcode}):\n{outcome.error}")
                rank = outcome.value
                if not rank["verified"]:
                    raise RuntimeError(f"{name}: the loaded state differs from the saved one")
                rank["server_cpu_s"] = server_cpu
                print(f"  round {round_index} {name:<28} save {rank['save_s']:7.2f} s, load "
                      f"{rank['load_s']:6.2f} s ({time.perf_counter() - started:.0f} s with "
                      f"start-up; {bench.server_name} {server_cpu:.1f} CPU s)", flush=True)
                if round_index:
                    rounds[name].append({"ranks": [rank]})
    return rounds


def summarize(bench: StoreBench, rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """bench.s3's summary (medians, ratios over raw and the peers), with the server's CPU
    seconds per GB (save and load, warm-up included), asynctron over `also_over` and the
    target over raw."""
    result = _s3_report.summarize(rounds, raw=bench.raw, peers=bench.peers)
    methods = result["methods"]
    for m in methods.values():
        moved_gb = 2 * m["nbytes"] / 1e9
        m["server_cpu_s_per_gb"] = _s3_report.median(
            [run["ranks"][0]["server_cpu_s"] / moved_gb for run in m["rounds"]])
    if OURS in methods:
        result["ratios"]["asynctron_over"] = {
            other: {what: methods[OURS][f"{what}_gb_per_s"] / methods[other][f"{what}_gb_per_s"]
                    for what in ("save", "load")}
            for other in bench.also_over if other in methods}
    if "asynctron_over_raw" in result["ratios"]:
        over = result["ratios"]["asynctron_over_raw"]
        result["targets"] = {f"asynctron / raw, {what}": {
            "ratio": over[what], "target": TARGET_OVER_RAW, "met": over[what] >= TARGET_OVER_RAW}
            for what in ("save", "load")}
    return result


def report(bench: StoreBench, result: dict[str, Any]) -> None:
    _s3_report.table(result["methods"], f"{bench.title} checkpoints: {result['nbytes'] / GiB:.2f} "
                     f"GiB state ({result['num_tensors']} tensors), one local "
                     f"{bench.server_name}")
    print(_s3_report.TABLE_LEGEND)
    print(f"{bench.server_name} CPU s per GB moved (save + load): " + ", ".join(
        f"{name} {m['server_cpu_s_per_gb']:.2f}" for name, m in result["methods"].items()))
    for name, target in result.get("targets", {}).items():
        print(f"{name}: {target['ratio']:.2f}x (target >= {target['target']}: "
              f"{'met' if target['met'] else 'NOT met'})")
    for other, over in result["ratios"].get("asynctron_over", {}).items():
        print(f"asynctron / {other}: save {over['save']:.2f}x, load {over['load']:.2f}x")
    for what, best in result["ratios"].get("asynctron_over_fastest_peer", {}).items():
        print(f"asynctron / peer, {what}: {best['ratio']:.2f}x ({best['peer']})")
    for name, reason in result["skipped"].items():
        print(f"not run: {name}: {reason}")


def _versions(bench: StoreBench) -> dict[str, str]:
    return {**_results.versions(("torch", *bench.distributions)), **bench.server_versions()}


def main(bench: StoreBench, description: str, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"asynctron bench {bench.name}",
                                     description=description)
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--part-mib", type=int, default=32,
                        help="part size of the raw baseline and the peer's block size")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests in flight of the raw baseline")
    parser.add_argument("--threads", type=int, default=4, help="FsspecWriter's thread_count")
    but = f" but {', '.join(bench.named_only)}" if bench.named_only else ""
    parser.add_argument("--only", default=",".join(
                            name for name in bench.methods if name not in bench.named_only),
                        help=f"comma-separated subset of the methods (default: all{but})")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the server keeps its files (/dev/shm: in memory)")
    parser.add_argument("--quick", action="store_true", help="tiny state, one round (smoke)")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    bench.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gib, args.repeats = min(args.size_gib, 0.008), 1
        args.part_mib = bench.quick_part_mib
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    if unknown := sorted(set(wanted) - set(bench.methods)):
        parser.error(f"--only: expected names from {list(bench.methods)}, found {unknown}")

    command = f"asynctron bench {bench.name}"
    started, load_average = time.time(), os.getloadavg()
    skipped = {name: reason for name in wanted if (reason := unavailable(bench, name))}
    for name, reason in skipped.items():
        print(f"{command}: skipping {name}: {reason}", flush=True)
    methods = [name for name in wanted if name not in skipped]
    if not methods:
        print(f"{command}: no method left to run", flush=True)
        return 1
    warmed = 0 if args.quick else _baselines.warm_guest_memory()
    base = _results.scratch_dir(f"asynctron-bench-{bench.name}-{os.getpid()}-", args.dir)
    saved_env = dict(os.environ)
    try:
        server = bench.start_server(os.path.join(base, "server"))
        try:
            os.environ.update({**server.environment(), **bench.rank_environment})
            rounds = run_rounds(bench, server, methods, args)
            versions = _versions(bench)
        finally:
            server.stop()
    except (FileNotFoundError, RuntimeError, OSError) as error:  # no server; a failed run
        print(f"{command}: {error}", flush=True)
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(base, ignore_errors=True)
    first_rank = next(iter(rounds.values()))[0]["ranks"][0]
    result = {"nbytes": first_rank["nbytes"], "world_size": 1,
              "num_tensors": first_rank["num_tensors"], **summarize(bench, rounds),
              "skipped": skipped}
    report(bench, result)
    result["meta"] = _results.run_meta(
        started, args, versions=versions, warmed_guest_memory_bytes=warmed,
        load_average_start=load_average, load_average_end=os.getloadavg(),
        server=f"{bench.server_description} on 127.0.0.1, files in {args.dir}")
    _results.write_results(bench.name, result, out=args.out)
    return 0


def job_with(job: Job, cls: type[Job], **extra: Any) -> Job:
    """`job` as a `cls` (a Job subclass), with `extra` fields set."""
    common = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    return cls(**common, **extra)
