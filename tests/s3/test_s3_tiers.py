"""Tiers with an S3 store (a real SeaweedFS behind a TCP proxy the test turns off and on), two
real ranks as two nodes: saves go on while the store is down and its drains say they failed,
the next drain once it is back catches up, a node lost with the store down is restored from
replicas, two nodes lost from the store; with both nodes lost and the store down, restore
raises a store error within the store's deadline (never "nothing saved"); the drained step
is an ordinary checkpoint."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
import uvloop

import asynctron
from asynctron import Engine
from asynctron._launch import run_local_ranks
from asynctron.storage.backends.s3 import S3Backend, S3Config
from asynctron.testing.seaweedfs import SeaweedFS
from asynctron.testing.tcp_proxy import TcpFaultProxy
from tests.distributed.test_tiers_ranks import SMALL, restore_into, save_steps, tiers_of
from tests.s3.conftest import keys_under

pytestmark = pytest.mark.slow


@pytest.fixture
def proxy(s3_env: SeaweedFS) -> Iterator[TcpFaultProxy]:
    host, _, port = s3_env.endpoint.removeprefix("http://").partition(":")
    with TcpFaultProxy.start(host, int(port)) as proxy:
        yield proxy


class _Lines(logging.Handler):
    """The tiers' log lines, and an event per phrase awaited."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.seen: dict[str, threading.Event] = {}

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        for phrase, event in self.seen.items():
            if phrase in line:
                event.set()

    async def wait_for(self, phrase: str) -> None:
        event = self.seen.setdefault(phrase, threading.Event())
        if any(phrase in line for line in self.lines):
            return
        assert await asyncio.to_thread(event.wait, 120), f"never logged: {phrase}"


def drain_while_the_store_is_down(rank: int, world: int, root: str, store: str,
                                  upstream: str) -> Any:
    """Rank 0 runs the proxy to the store (down, then up), both ranks save through it: saves
    go on while it is down, the drain says it failed, and the next step drains once it is
    back."""
    os.environ["ASYNCTRON_RANKS_PER_NODE"] = "1"
    lines = _Lines()
    logging.getLogger("asynctron.engine.tiers").addHandler(lines)
    logging.getLogger("asynctron.engine.tiers").setLevel(logging.INFO)
    proxy = None
    endpoint = [None]
    if rank == 0:
        host, _, port = upstream.removeprefix("http://").partition(":")
        proxy = TcpFaultProxy.start(host, int(port))
        proxy.refuse()
        endpoint = [proxy.endpoint]
    dist.broadcast_object_list(endpoint, src=0)
    backend = S3Backend(S3Config(endpoint_url=endpoint[0], deadline_s=2, read_timeout_s=2,
                                 connect_timeout_s=1))

    async def main() -> list[int]:
        async with Engine(tiers=tiers_of(root, store=store, store_every=2),
                          store_backend=backend, **SMALL) as engine:
            saved = await save_steps(rank, 1, engine, [1, 2])
            await lines.wait_for("drain of step 2 to ")
            await asyncio.to_thread(dist.barrier)
            if proxy is not None:
                proxy.pass_through()
            await asyncio.to_thread(dist.barrier)
            saved += await save_steps(rank, 1, engine, [3])
            await lines.wait_for("step 3 drained to ")
        return saved

    try:
        return {"saved": uvloop.run(main()), "log": lines.lines}
    finally:
        if proxy is not None:
            proxy.stop()


def restore_through(rank: int, world: int, root: str, store: str, endpoint: str) -> Any:
    os.environ["ASYNCTRON_RANKS_PER_NODE"] = "1"
    backend = S3Backend(S3Config(endpoint_url=endpoint, deadline_s=2, read_timeout_s=2,
                                 connect_timeout_s=1))

    async def main() -> Any:
        async with Engine(tiers=tiers_of(root, store=store), store_backend=backend,
                          **SMALL) as engine:
            started = time.monotonic()
            try:
                return await restore_into(rank, 1, engine)
            except Exception as error:
                return {"error": type(error).__name__, "message": str(error),
                        "not found": isinstance(error, asynctron.CheckpointNotFoundError),
                        "seconds": time.monotonic() - started}

    return uvloop.run(main())


def test_a_store_down_stops_no_save_and_no_restore_from_replicas(
        tmp_path: Any, s3_root: str, s3_env: SeaweedFS, proxy: TcpFaultProxy,
        s3_objects: Any) -> None:
    root = str(tmp_path)
    found = [r.unwrap() for r in run_local_ranks(drain_while_the_store_is_down, 2, root,
                                                 s3_root, s3_env.endpoint, timeout_s=240)]
    assert [f["saved"] for f in found] == [[1, 2, 3]] * 2  # the local tiers went on
    log = " | ".join(found[0]["log"])
    assert "failed (the next complete step is drained instead)" in log, log
    assert "connection refused" in log
    names = {key.split("/")[0] for key in keys_under(s3_objects, s3_root)}
    assert names == {"latest", "step_00000003"}

    def restore() -> list[Any]:
        return [r.unwrap() for r in run_local_ranks(restore_through, 2, root, s3_root,
                                                    proxy.endpoint, timeout_s=240)]

    shutil.rmtree(f"{root}/node1")  # node 1 lost, and the store down again
    proxy.refuse()
    found = restore()
    assert all(f["step"] == 3 and f["exact"] for f in found), found
    assert found[0]["sources"] == ("local", "replica")

    # both nodes lost, the store down: not a first start, a store error within its deadline
    shutil.rmtree(f"{root}/node0")
    found = restore()
    assert all(f.get("error") == "StorageError" and not f["not found"] for f in found), found
    assert "not a first start" in found[0]["message"] and s3_root in found[0]["message"]
    assert all(f["seconds"] < 60 for f in found), found  # a guard against a hang, not timing

    proxy.pass_through()
    found = restore()
    assert all(f["step"] == 3 and f["exact"] for f in found), found
    assert found[0]["sources"] == ("store", "store")
    assert asynctron.load(f"{s3_root}/step_00000003")["step"] == 3  # an ordinary checkpoint
