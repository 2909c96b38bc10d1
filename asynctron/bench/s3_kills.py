"""Saving processes killed at random on object storage: what is left in the bucket.

Against a local S3-compatible server (SeaweedFS, started here): saver processes save small
checkpoints back to back with `keep_last=3` under one root, each SIGKILLed after a random
delay (mid-upload, mid-commit, mid-pruning: wherever it is), until `--saves` saves were
started; then one clean save. Target: the root then holds exactly the 3 retained checkpoints,
`latest` and the ledger: no orphan object, no claim, no open multipart upload.

Run: `asynctron bench s3_kills` (`--saves 200`); `--quick` for a smoke run. Results: printed,
and written as JSON (`--out`; default ./asynctron-bench/).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

from asynctron.bench import _results

KEEP_LAST = 3

_SAVER = textwrap.dedent("""
    import asyncio, sys, torch
    from asynctron import Engine

    async def main(root, first):
        torch.manual_seed(first)
        state = {"w": torch.randn(2 << 20), "small": [torch.randn(10) for _ in range(100)]}
        async with Engine(keep_last=int(sys.argv[3]), job="run", slab_bytes=4 << 20) as engine:
            print("ready", flush=True)
            for step in range(first, first + 100000):
                print("start", step, flush=True)
                await engine.save(state, f"{root}/step_{step:06d}")
                print("committed", step, flush=True)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctron bench s3_kills", description=__doc__)
    parser.add_argument("--saves", type=int, default=200, help="saves started in all")
    parser.add_argument("--max-life-s", type=float, default=8.0,
                        help="a saver is killed this long after it is ready, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 12 saves")
    parser.add_argument("--out", default=None, help="results file or directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.saves, args.max_life_s = 12, 3.0

    from asynctron.testing.seaweedfs import SeaweedFS

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="asynctron-s3-kills-") as scratch, \
            SeaweedFS.start(scratch) as server:
        env = os.environ | server.environment()
        root = f"s3://{server.bucket}/kills"
        started = killed = committed = 0
        began = time.perf_counter()
        while started < args.saves:
            saver = subprocess.Popen([sys.executable, "-c", _SAVER, root, str(started * 10),
                                      str(KEEP_LAST)],
                                     stdout=subprocess.PIPE, text=True, env=env)
            assert saver.stdout is not None
            saver.stdout.readline()  # ready: the engine is up, nothing saved yet
            deadline = time.monotonic() + rng.uniform(0.05, args.max_life_s)
            os.set_blocking(saver.stdout.fileno(), False)
            while time.monotonic() < deadline and saver.poll() is None:
                time.sleep(0.01)
            saver.send_signal(signal.SIGKILL)
            saver.wait()
            os.set_blocking(saver.stdout.fileno(), True)
            lines = saver.stdout.read().split("\n")
            started += sum(line.startswith("start") for line in lines)
            committed += sum(line.startswith("committed") for line in lines)
            killed += 1
        os.environ.update(server.environment())
        asyncio.run(_final_save(root))
        left = _what_is_left(server, "kills")
        elapsed_s = time.perf_counter() - began
    checkpoints = sorted(key.split("/")[0] for key in left["objects"]
                         if key.endswith("/manifest.json"))
    stray = [key for key in left["objects"]
             if key.split("/")[0] not in checkpoints
             and key not in ("latest", ".asynctron-ledger")]
    result: dict[str, Any] = {
        "saves_started": started, "saves_committed": committed, "savers_killed": killed,
        "checkpoints_left": checkpoints, "stray_objects": stray,
        "open_uploads": left["uploads"], "elapsed_s": elapsed_s,
        "met": len(checkpoints) == KEEP_LAST and not stray and not left["uploads"]}
    print(f"{started} saves started, {committed} committed, {killed} savers SIGKILLed "
          f"({elapsed_s:.0f} s)")
    print(f"left under the root: {len(checkpoints)} checkpoints {checkpoints}, "
          f"{len(stray)} stray objects, {len(left['uploads'])} open uploads: "
          f"{'met' if result['met'] else 'NOT MET'} (target: exactly {KEEP_LAST}, 0, 0)")
    _results.write_results("s3_kills", result, out=args.out)
    return 0 if result["met"] else 1


async def _final_save(root: str) -> None:
    import torch

    from asynctron import Engine

    async with Engine(keep_last=KEEP_LAST, job="run") as engine:
        await engine.save({"w": torch.zeros(1000)}, f"{root}/step_999999")


def _what_is_left(server: Any, prefix: str) -> dict[str, list[str]]:
    import botocore.session

    env = server.environment()
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    objects = [entry["Key"][len(prefix) + 1:] for page in client.get_paginator(
        "list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix + "/")
        for entry in page.get("Contents", ())]
    uploads = client.list_multipart_uploads(Bucket=server.bucket, Prefix=prefix + "/")
    return {"objects": sorted(objects),
            "uploads": sorted(upload["Key"] for upload in uploads.get("Uploads", ()))}


if __name__ == "__main__":
    sys.exit(main())
