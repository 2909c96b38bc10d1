"""Faults between asynctron and a real store: the connection cut mid-upload (a TCP proxy that
resets it, as a dying server does), transient resets retried, a saving process killed at random.
Each time: no partial checkpoint visible, the previous one intact, nothing left behind."""

from __future__ import annotations

import asyncio
import http.server
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asynctron import Engine
from asynctron._knobs import STORE_DEADLINE_S
from asynctron.errors import StorageError
from asynctron.storage import StoreStatistics
from asynctron.storage.backends.objects._requests import REFUSED_GRACE_S
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
        with pytest.raises(StorageError, match=r"step_4.* at http://127\.0\.0\.1:\d+: the store "
                           r"answered none of this load's requests for 3\.\d s"):
            await engine.load(f"{s3_root}/step_4")
        assert time.monotonic() - started < 20
        proxy.pass_through()
        assert_same(_state(4), await engine.load(f"{s3_root}/step_4"))


async def test_a_save_whose_every_upload_is_reset_fails_within_one_deadline(
        s3_root: str, s3_env: SeaweedFS, proxy: TcpFaultProxy, s3_objects: Any) -> None:
    """A save is parts, the upload's abort, the deletes and the claim's removal: each used to
    wait a deadline of its own (238.6 s for a 60 s deadline). One clock now: the save fails
    once the store answered none of its requests for `deadline_s`; clean-up that cannot reach
    the store is left to the next commit's sweep, never waited for."""
    deadline_s = 3.0
    backend = _through(proxy, s3_env, deadline_s=deadline_s)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(0), f"{s3_root}/step_0")
        proxy.reset_each_after(6 << 20)  # every part breaks; small requests still get through
        started = time.monotonic()
        with pytest.raises(StorageError) as caught:
            await engine.save(_state(1), f"{s3_root}/step_1")
        waited_s = time.monotonic() - started
        message = str(caught.value)
        assert re.search(rf"step_1/__0_\d\.distcp part \d+ at {re.escape(proxy.endpoint)}: .*"
                         r"for \d\.\d s", message), message
        assert waited_s < deadline_s + 4, (waited_s, message)  # the bug: 4 deadlines and more
        proxy.pass_through()
        assert_same(_state(0), await engine.load(s3_root))
        await engine.save(_state(2), f"{s3_root}/step_2")  # its commit sweeps step_1's debris
    names = {key.split("/")[0] for key in keys_under(s3_objects, s3_root)}
    assert names == {"latest", "step_0", "step_2"}
    assert uploads_under(s3_objects, s3_root) == []


async def test_a_dead_store_fails_every_request_of_the_operation_at_once(
        s3_root: str, s3_env: SeaweedFS, proxy: TcpFaultProxy) -> None:
    """Once the clock ran out, the operation asks nothing more of the store: the writers'
    aborts and the claim's removal fail at once (logged), they do not each wait again."""
    backend = _through(proxy, s3_env, deadline_s=2)
    async with Engine(backend=backend, slab_bytes=8 << 20, num_bins=4) as engine:
        await engine.save(_state(0), f"{s3_root}/step_0")
        opened = proxy.connections_opened
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(StorageError, match="answered none of this save's requests"):
            await engine.save(_state(1), f"{s3_root}/step_1")
        assert time.monotonic() - started < 2 + 4
        assert proxy.connections_opened - opened < 40  # no retry storm after the clock ran out
        proxy.pass_through()


async def test_a_save_reports_what_it_asked_of_the_store(
        s3_root: str, s3_env: SeaweedFS, proxy: TcpFaultProxy) -> None:
    """`SaveResult.store`: requests, retries, bytes and the time spent waiting on the store,
    so a slow save can be blamed on the store or on us."""
    backend = _through(proxy, s3_env, deadline_s=10)
    state = {"w": torch.randn(24 << 20)}
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        proxy.reset_each_after(1 << 20)  # every part breaks, until 16 MiB have gone up
        task = engine.save(state, f"{s3_root}/step_0")
        assert await asyncio.to_thread(proxy.wait_for_bytes_up, proxy.bytes_up + (16 << 20), 30)
        proxy.pass_through()
        store = (await task).store
        assert store.num_retries >= 1 and store.num_requests > store.num_retries + 4
        assert store.sent_bytes >= 96 << 20 and store.received_bytes == 0
        assert store.num_throttled == 0 and store.waiting_s > 0
        assert_same(state, await engine.load(f"{s3_root}/step_0"))
    local = await _save_locally(state)
    assert local.store == StoreStatistics()


async def _save_locally(state: dict[str, Any]) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        async with Engine() as engine:
            return await engine.save(state, f"{directory}/step_0")


def _unreachable(endpoint: str) -> S3Backend:
    return S3Backend(S3Config(endpoint_url=endpoint, access_key_id="k", secret_access_key="s",
                              deadline_s=60, connect_timeout_s=2))


async def test_nothing_listening_at_the_endpoint_fails_after_a_short_grace(
        tmp_path: Any) -> None:
    """A typo'd port used to cost the whole deadline (60 s) per call."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    async with Engine(backend=_unreachable(f"http://127.0.0.1:{port}")) as engine:
        with pytest.raises(StorageError, match=rf"connection refused for \d\.\d s .*nothing "
                                               rf"listens at 127\.0\.0\.1:{port}; is the store up"):
            await engine.load("s3://bucket/run")
    assert time.monotonic() - started < REFUSED_GRACE_S + 5


async def test_an_unknown_host_fails_at_once() -> None:
    started = time.monotonic()
    async with Engine(backend=_unreachable("http://no-such-host.invalid:9000")) as engine:
        with pytest.raises(StorageError, match=r"the host 'no-such-host\.invalid:9000' was not "
                                               r"found .*fix the endpoint's host"):
            await engine.load("s3://bucket/run")
    assert time.monotonic() - started < 5


@pytest.fixture
def plain_http_port() -> Iterator[int]:
    """A plain HTTP server that is not S3 (every path: 404 Not Found)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


async def test_tls_against_a_plain_http_port_fails_at_once(plain_http_port: int) -> None:
    started = time.monotonic()
    async with Engine(backend=_unreachable(f"https://127.0.0.1:{plain_http_port}")) as engine:
        with pytest.raises(StorageError, match=r"TLS handshake with 127\.0\.0\.1:\d+ failed .*"
                                               r"make the endpoint URL http://"):
            await engine.load("s3://bucket/run")
    assert time.monotonic() - started < 5


async def test_an_endpoint_that_is_not_s3_is_named(plain_http_port: int) -> None:
    async with Engine(backend=_unreachable(f"http://127.0.0.1:{plain_http_port}")) as engine:
        with pytest.raises(FileNotFoundError, match=r"answered 404 without an S3 error document; "
                                                     r"is http://127\.0\.0\.1:\d+ an S3 endpoint"):
            await engine.load("s3://bucket/run")


def test_the_cli_takes_the_deadline(s3_env: SeaweedFS, proxy: TcpFaultProxy,
                                    s3_root: str) -> None:
    proxy.stall()
    env = os.environ | s3_env.environment() | {"AWS_ENDPOINT_URL": proxy.endpoint,
                                               STORE_DEADLINE_S: "60"}
    done = subprocess.run([sys.executable, "-m", "asynctron", "verify", "--deadline-s", "1.5",
                           s3_root], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(r"asynctron verify: get_object \S+/latest at http://\S+: the store "
                        r"answered none of this verify's requests for 1\.5 s [^\n]*\n",
                        done.stderr), done.stderr
    proxy.pass_through()
