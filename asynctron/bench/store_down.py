"""A store that stops answering in the middle of an operation: how long a save, a load and a
dataset read each take to fail against the store's deadline (`--deadline-s`), and whether the
checkpoints committed before it still load (what the failure left behind).

One local SeaweedFS behind a TCP proxy (`asynctron.testing.tcp_proxy`), one process whose
store (the environment's: `AWS_ENDPOINT_URL` names the proxy) has `deadline_s = --deadline-s`
(`ASYNCTRON_STORE_DEADLINE_S`, as a user sets it). Faults: `stalled` (the proxy stops forwarding
either way: a hung store or network) and `down` (every connection reset, then the port
closed: a dead server). For each fault:
- save: step_0 saved whole, then step_1 (`--size-gib`), the fault switched on once
  `--after-mib` of it went up; timed from the fault to the error;
- load: the fault switched on, then a load of the root; timed from the call to the error;
- dataset read: an `IndexedDataset` over the proxy (a fresh cache), a sample read (cached),
  the fault switched on, a sample of another block read; timed from the call to the error.
Then the fault is cleared and the run checks: the root's `latest` still loads step_0 bit for
bit, step_1 was never committed, and a new save commits. Target: each fails within
`deadline_s` + 10%.

Run: `asynctron bench s3_down` (`--deadline-s 60`, the default); `--quick` for a smoke run.
Run it in a fresh process (the CLI does): a process reads the store's endpoint and deadline
from the environment once, at its first s3:// URL.
Results: printed, and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
from typing import Any

import numpy as np
import torch

from asynctron._knobs import STORE_DEADLINE_S
from asynctron.bench import _results

MiB = 1 << 20
GiB = 1 << 30
FAULTS = ("stalled", "down")
OPERATIONS = ("save", "load", "dataset read")
MARGIN = 0.1


def _state(nbytes: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    count = max(1, nbytes // (64 * MiB))
    return {f"layer{i}": torch.randn(nbytes // count // 4, generator=generator)
            for i in range(count)} | {"step": seed}


def _switch(proxy: Any, fault: str) -> None:
    if fault == "stalled":
        proxy.stall()
    else:
        proxy.reset()
        proxy.refuse()


async def _timed_failure(work: Any) -> tuple[float, str]:
    """Seconds until `work` raised, and its error (one line); a success is a failure of the
    benchmark."""
    started = time.monotonic()
    try:
        await work
    except Exception as error:
        return time.monotonic() - started, f"{type(error).__name__}: {error}"
    raise RuntimeError("expected the operation to fail against a store that stopped "
                       "answering, found it succeeded")


async def run_fault(server: Any, proxy: Any, fault: str, args: argparse.Namespace,
                    work: str) -> dict[str, Any]:
    """One fault against a save, a load and a dataset read; then the checks."""
    from asynctron import Engine
    from asynctron.datasets import IndexedDataset, ObjectStorageConfig
    from asynctron.storage.backends import backend_for

    root = f"s3://{server.bucket}/{fault}"
    nbytes = int(args.size_gib * GiB)
    out: dict[str, Any] = {}
    async with Engine() as engine:  # the process's S3 backend: the environment's store
        await engine.save(_state(nbytes, 0), f"{root}/step_0")
        up = proxy.bytes_up
        task = engine.save(_state(nbytes, 1), f"{root}/step_1")
        reached = await asyncio.to_thread(proxy.wait_for_bytes_up, up + args.after_mib * MiB,
                                          600.0)
        if not reached:
            raise RuntimeError(f"the save sent less than {args.after_mib} MiB in 600 s")
        _switch(proxy, fault)
        out["save"] = await _timed_failure(task)
        out["load"] = await _timed_failure(engine.load(root))
        proxy.pass_through()

        dataset = IndexedDataset(f"{root}/corpus", mmap=False,
                                 object_storage_config=ObjectStorageConfig(
                                     os.path.join(work, f"cache-{fault}")))
        first = np.asarray(dataset[0])
        _switch(proxy, fault)
        out["dataset read"] = await _timed_failure(
            asyncio.to_thread(dataset.__getitem__, len(dataset) - 1))
        proxy.pass_through()
        out["dataset still right"] = bool(np.array_equal(dataset[0], first))
        loaded = await engine.load(root)
        out["previous intact"] = bool(loaded["step"] == 0 and all(
            torch.equal(loaded[key], value) for key, value in _state(nbytes, 0).items()
            if isinstance(value, torch.Tensor)))
        out["step_1 committed"] = "step_1" in await backend_for(root).checkpoints(
            engine.run_blocking).list_checkpoints(root)
        await engine.save(_state(MiB, 2), f"{root}/step_2")
        out["saves again"] = (await engine.load(root))["step"] == 2
    return out


def _write_corpus(server: Any, fault: str, work: str) -> None:
    """A small token corpus uploaded under the fault's root (its last sample in a block of
    its own, far from the first)."""
    import botocore.session

    from asynctron.datasets import write_indexed_dataset

    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 50_000, 4096, dtype=np.uint16) for _ in range(512)]
    local = write_indexed_dataset(os.path.join(work, f"corpus-{fault}", "c"), documents,
                                  dtype=np.uint16)
    env = server.environment()
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    for suffix in (".bin", ".idx"):
        with open(local.path_prefix + suffix, "rb") as f:
            client.put_object(Bucket=server.bucket, Key=f"{fault}/corpus{suffix}", Body=f.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench s3_down",
                                     description=_results.description(__doc__))
    parser.add_argument("--deadline-s", type=float, default=60.0, help="the store's deadline")
    parser.add_argument("--size-gib", type=float, default=0.25, help="the state saved")
    parser.add_argument("--after-mib", type=int, default=64,
                        help="the fault begins once this much of the save went up")
    parser.add_argument("--dir", default=os.getcwd(), help="where the server keeps its data")
    parser.add_argument("--quick", action="store_true", help="a 2 s deadline, a tiny state")
    parser.add_argument("--out", default=None, help=_results.OUT_HELP)
    args = parser.parse_args(argv)
    if args.quick:
        args.deadline_s, args.size_gib, args.after_mib = 2.0, 1 / 32, 4
    import uvloop

    from asynctron.testing.seaweedfs import SeaweedFS
    from asynctron.testing.tcp_proxy import TcpFaultProxy

    started = time.time()
    work = _results.scratch_dir(f"asynctron-bench-s3-down-{os.getpid()}-", args.dir)
    results: dict[str, Any] = {}
    saved_env = dict(os.environ)
    try:
        with SeaweedFS.start(os.path.join(work, "seaweedfs")) as server:
            host, _, port = server.endpoint.removeprefix("http://").partition(":")
            with TcpFaultProxy.start(host, int(port)) as proxy:
                # before this process's first s3:// URL: its backend reaches the store
                # through the proxy, with the deadline under test
                os.environ.update(server.environment() | {
                    "AWS_ENDPOINT_URL": proxy.endpoint,
                    STORE_DEADLINE_S: str(args.deadline_s)})
                for fault in FAULTS:
                    _write_corpus(server, fault, work)
                    results[fault] = uvloop.run(run_fault(server, proxy, fault, args, work))
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(work, ignore_errors=True)
    limit = args.deadline_s * (1 + MARGIN)
    print(f"\n== a store that stops answering: deadline_s {args.deadline_s:g} s, target "
          f"<= {limit:.1f} s ==")
    print(f"{'fault':<10}{'operation':<14}{'failed after':>14}  error")
    met = True
    for fault, found in results.items():
        for operation in OPERATIONS:
            seconds, error = found[operation]
            met &= seconds <= limit
            print(f"{fault:<10}{operation:<14}{seconds:>12.1f} s  {error[:150]}")
        print(f"{'':<10}previous checkpoint intact: {found['previous intact']}, step_1 "
              f"committed: {found['step_1 committed']}, saves again: {found['saves again']}, "
              f"cached samples still right: {found['dataset still right']}")
    print(f"every failure within deadline_s + {MARGIN:.0%}: {'met' if met else 'NOT met'}")
    summary = {"deadline_s": args.deadline_s, "limit_s": limit, "met": met,
               "faults": {fault: {**found, **{op: {"failed_after_s": found[op][0],
                                                   "error": found[op][1]}
                                            for op in OPERATIONS}}
                          for fault, found in results.items()}}
    summary["meta"] = _results.run_meta(started, args)
    _results.write_results("s3_down", summary, out=args.out)
    intact = all(found["previous intact"] and not found["step_1 committed"]
                 and found["saves again"] and found["dataset still right"]
                 for found in results.values())
    return 0 if met and intact else 1


if __name__ == "__main__":
    raise SystemExit(main())
