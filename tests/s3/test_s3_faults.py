"""Faults between asynctron and a real store: the connection cut mid-upload (a TCP proxy that
resets it, as a dying server does), transient resets retried, a saving process killed at random.
Each time: no partial checkpoint visible, the previous one intact, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asynctron import Engine
from asynctron.errors import StorageError
from asynctron.storage.backends.s3 import S3Backend, S3Config
from asynctron.testing.seaweedfs import SeaweedFS
from asynctron.testing.tcp_proxy import TcpFaultProxy
from tests.conftest import assert_same
from tests.s3.conftest import keys_under, uploads_under


@pytest.fixture
def proxy(s3_env: SeaweedFS) -> Iterator[TcpFaultProxy]:
    host, _, port = s3_env.endpoint.removeprefix("http://").partition(":")
    with TcpFaultProxy.start(host, int(port)) as proxy:
        yield proxy


def _through(proxy: TcpFaultProxy, server: SeaweedFS, *, deadline_s: float) -> S3Backend:
    env = server.environment()
    return S3Backend(S3Config(endpoint_url=proxy.endpoint, access_key_id=env["AWS_ACCESS_KEY_ID"],
                              secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                              deadline_s=deadline_s, read_timeout_s=2, connect_timeout_s=1))


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(6 << 20), "v": torch.randn(1000), "step": seed}


async def test_a_store_gone_mid_save_fails_clearly_and_keeps_the_previous_checkpoint(
        s3_root: str, s3_env: SeaweedFS, proxy: TcpFaultProxy, s3_objects: Any) -> None:
    backend = _through(proxy, s3_env, deadline_s=2)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(0), f"{s3_root}/step_0")
        proxy.drop_after(12 << 20)  # the store dies 12 MiB into the next save, stays dead
        started = time.monotonic()
        with pytest.raises(StorageError) as caught:
            await engine.save(_state(1), f"{s3_root}/step_1")
        assert time.monotonic() - started < 30
        assert "step_1/" in str(caught.value) and proxy.endpoint in str(caught.value)
        proxy.pass_through()  # back up: the same engine goes on
        assert_same(_state(0), await engine.load(s3_root))
        await engine.save(_state(2), f"{s3_root}/step_2")
        assert_same(_state(2), await engine.load(s3_root))
    names = {key.split("/")[0] for key in keys_under(s3_objects, s3_root)}
    assert names == {"latest", "step_0", "step_2"}  # the failed save left nothing
    assert uploads_under(s3_objects, s3_root) == []


async def test_connection_resets_are_retried_inside_the_deadline(
        s3_root: str, s3_env: SeaweedFS, proxy: TcpFaultProxy) -> None:
    backend = _through(proxy, s3_env, deadline_s=30)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        proxy.drop_after(10 << 20, then="pass_through")  # one cut mid-upload, then fine
        await engine.save(_state(3), f"{s3_root}/step_3")
        assert proxy.connections_opened > 1
        assert_same(_state(3), await engine.load(f"{s3_root}/step_3"))


_SAVER = textwrap.dedent("""
    import asyncio, sys, torch
    from asynctron import Engine

    async def main(root, first):
        torch.manual_seed(first)
        state = {"w": torch.randn(2 << 20), "small": [torch.randn(10) for _ in range(50)]}
        async with Engine(keep_last=3, job="run", slab_bytes=4 << 20) as engine:
            for step in range(first, first + 1000):
                await engine.save(state, f"{root}/step_{step:04d}")
                print(step, flush=True)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


async def _save_once(root: str) -> None:
    async with Engine(keep_last=3, job="run") as engine:
        await engine.save(_state(9), f"{root}/step_9000")


@pytest.mark.slow
def test_saving_processes_killed_at_random_leave_only_retained_checkpoints(
        s3_root: str, s3_objects: Any) -> None:
    rng = random.Random(0)
    for round_ in range(3):
        saver = subprocess.Popen([sys.executable, "-c", _SAVER, s3_root, str(round_ * 1000)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=os.environ | {"PYTHONPATH": os.getcwd()})
        assert saver.stdout is not None
        saver.stdout.readline()  # one commit done: the engine is warm
        time.sleep(rng.uniform(0.0, 1.5))
        saver.send_signal(signal.SIGKILL)
        saver.communicate()
    asyncio.run(_save_once(s3_root))
    keys = keys_under(s3_objects, s3_root)
    checkpoints = {key.split("/")[0] for key in keys} - {"latest", ".asynctron-ledger"}
    assert len(checkpoints) == 3 and "step_9000" in checkpoints, keys
    for name in checkpoints:
        assert f"{name}/manifest.json" in keys
    assert not [key for key in keys if key.startswith(".") and key != ".asynctron-ledger"]
    assert uploads_under(s3_objects, s3_root) == []


async def test_a_pruner_killed_midway_leaves_the_rest_to_the_next_commit(
        s3_root: str, s3_objects: Any) -> None:
    bucket, _, prefix = s3_root[5:].partition("/")
    async with Engine(keep_last=2, job="run") as engine:
        await engine.save(_state(0), f"{s3_root}/step_0")
        await engine.save(_state(1), f"{s3_root}/step_1")
    # What a pruner of step_0 leaves when killed after marking it and deleting its manifest:
    ledger = s3_objects.get_object(Bucket=bucket, Key=f"{prefix}/.asynctron-ledger")
    lines = ledger["Body"].read().decode().splitlines()
    marked = [line.replace("}", ',"pruning":true}') if '"step_0"' in line else line
              for line in lines]
    s3_objects.put_object(Bucket=bucket, Key=f"{prefix}/.asynctron-ledger",
                          Body="".join(f"{line}\n" for line in marked).encode())
    s3_objects.delete_object(Bucket=bucket, Key=f"{prefix}/step_0/manifest.json")
    async with Engine(keep_last=2, job="run") as engine:
        await engine.save(_state(2), f"{s3_root}/step_2")
    names = {key.split("/")[0] for key in keys_under(s3_objects, s3_root)}
    assert names == {".asynctron-ledger", "latest", "step_1", "step_2"}


async def test_a_stalled_store_fails_a_load_within_the_deadline_naming_the_object(
        s3_root: str, s3_env: SeaweedFS, proxy: TcpFaultProxy) -> None:
    backend = _through(proxy, s3_env, deadline_s=3)
    async with Engine(backend=backend) as engine:
        await engine.save(_state(4), f"{s3_root}/step_4")
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(StorageError, match=r"step_4.*no answer for 3 s"):
            await engine.load(f"{s3_root}/step_4")
        assert time.monotonic() - started < 20
        proxy.pass_through()
        assert_same(_state(4), await engine.load(f"{s3_root}/step_4"))
