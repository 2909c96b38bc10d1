"""Faults between asynctron and each real store (S3, Azure Blob): the connection cut
mid-upload (a TCP proxy that resets it, as a dying server does), transient resets retried, a
stalled store, a saving process killed at random. Each time: no partial checkpoint visible,
the previous one intact, nothing left behind, and failure within one deadline."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from asynctron import Engine
from asynctron.errors import StorageError
from asynctron.storage import StoreStatistics
from asynctron.testing.tcp_proxy import TcpFaultProxy
from tests.conftest import assert_same
from tests.objects.conftest import Store

pytestmark = pytest.mark.slow  # each waits out a deadline, a proxy's fault or killed savers


def _through(proxy: TcpFaultProxy, store: Store, *, deadline_s: float) -> Any:
    return store.backend(proxy.endpoint, deadline_s=deadline_s, read_timeout_s=2,
                         connect_timeout_s=1)


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(6 << 20), "v": torch.randn(1000), "step": seed}


async def test_a_store_gone_mid_save_fails_clearly_and_keeps_the_previous_checkpoint(
        store: Store, proxy: TcpFaultProxy) -> None:
    backend = _through(proxy, store, deadline_s=2)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(0), f"{store.root}/step_0")
        proxy.drop_after(12 << 20)  # the store dies 12 MiB into the next save, stays dead
        started = time.monotonic()
        with pytest.raises(StorageError) as caught:
            await engine.save(_state(1), f"{store.root}/step_1")
        assert time.monotonic() - started < 30
        assert "step_1/" in str(caught.value) and proxy.endpoint in str(caught.value)
        proxy.pass_through()  # back up: the same engine goes on
        assert_same(_state(0), await engine.load(store.root))
        await engine.save(_state(2), f"{store.root}/step_2")
        assert_same(_state(2), await engine.load(store.root))
    names = {key.split("/")[0] for key in store.keys_under(store.root)}
    assert names == {"latest", "step_0", "step_2"}  # the failed save left nothing
    assert store.uploads_under(store.root) == []


async def test_connection_resets_are_retried_inside_the_deadline(
        store: Store, proxy: TcpFaultProxy) -> None:
    backend = _through(proxy, store, deadline_s=30)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        proxy.drop_after(10 << 20, then="pass_through")  # one cut mid-upload, then fine
        await engine.save(_state(3), f"{store.root}/step_3")
        assert proxy.connections_opened > 1
        assert_same(_state(3), await engine.load(f"{store.root}/step_3"))


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
        store: Store) -> None:
    rng = random.Random(0)
    for round_ in range(2):
        saver = subprocess.Popen([sys.executable, "-c", _SAVER, store.root, str(round_ * 1000)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=os.environ | {"PYTHONPATH": os.getcwd()})
        assert saver.stdout is not None
        saver.stdout.readline()  # one commit done: the engine is warm
        time.sleep(rng.uniform(0.0, 1.5))
        saver.send_signal(signal.SIGKILL)
        saver.communicate()
    asyncio.run(_save_once(store.root))
    keys = store.keys_under(store.root)
    checkpoints = {key.split("/")[0] for key in keys} - {"latest", ".asynctron-ledger"}
    assert len(checkpoints) == 3 and "step_9000" in checkpoints, keys
    for name in checkpoints:
        assert f"{name}/manifest.json" in keys
    assert not [key for key in keys if key.startswith(".") and key != ".asynctron-ledger"]
    assert store.uploads_under(store.root) == []


async def test_a_pruner_killed_midway_leaves_the_rest_to_the_next_commit(
        store: Store) -> None:
    async with Engine(keep_last=2, job="run") as engine:
        await engine.save(_state(0), f"{store.root}/step_0")
        await engine.save(_state(1), f"{store.root}/step_1")
    # What a pruner of step_0 leaves when killed after marking it and deleting its manifest:
    lines = store.get(f"{store.root}/.asynctron-ledger").decode().splitlines()
    marked = [line.replace("}", ',"pruning":true}') if '"step_0"' in line else line
              for line in lines]
    store.put(f"{store.root}/.asynctron-ledger",
              "".join(f"{line}\n" for line in marked).encode())
    store.delete(f"{store.root}/step_0/manifest.json")
    async with Engine(keep_last=2, job="run") as engine:
        await engine.save(_state(2), f"{store.root}/step_2")
    names = {key.split("/")[0] for key in store.keys_under(store.root)}
    assert names == {".asynctron-ledger", "latest", "step_1", "step_2"}


async def test_a_stalled_store_fails_a_load_within_the_deadline_naming_the_object(
        store: Store, proxy: TcpFaultProxy) -> None:
    backend = _through(proxy, store, deadline_s=3)
    async with Engine(backend=backend) as engine:
        await engine.save(_state(4), f"{store.root}/step_4")
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(StorageError, match=r"step_4.* at http://127\.0\.0\.1:\d+\S*: the store "
                           r"answered none of this load's requests for 3\.\d s"):
            await engine.load(f"{store.root}/step_4")
        assert time.monotonic() - started < 20
        proxy.pass_through()
        assert_same(_state(4), await engine.load(f"{store.root}/step_4"))


async def test_a_save_whose_every_upload_is_reset_fails_within_one_deadline(
        store: Store, proxy: TcpFaultProxy) -> None:
    """A save is parts, the upload's abort, the deletes and the claim's removal: each used to
    wait a deadline of its own (238.6 s for a 60 s deadline). One clock now: the save fails
    once the store answered none of its requests for `deadline_s`; clean-up that cannot reach
    the store is left to the next commit's sweep, never waited for."""
    deadline_s = 3.0
    backend = _through(proxy, store, deadline_s=deadline_s)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(0), f"{store.root}/step_0")
        proxy.reset_each_after(6 << 20)  # every part breaks; small requests still get through
        started = time.monotonic()
        with pytest.raises(StorageError) as caught:
            await engine.save(_state(1), f"{store.root}/step_1")
        waited_s = time.monotonic() - started
        message = str(caught.value)
        assert re.search(rf"step_1/__0_\d\.distcp (part|block) \d+ at "
                         rf"{re.escape(proxy.endpoint)}\S*: .*for \d\.\d s", message), message
        assert waited_s < deadline_s + 4, (waited_s, message)  # the bug: 4 deadlines and more
        proxy.pass_through()
        assert_same(_state(0), await engine.load(store.root))
        await engine.save(_state(2), f"{store.root}/step_2")  # its commit sweeps step_1's debris
    names = {key.split("/")[0] for key in store.keys_under(store.root)}
    assert names == {"latest", "step_0", "step_2"}
    assert store.uploads_under(store.root) == []


async def test_a_dead_store_fails_every_request_of_the_operation_at_once(
        store: Store, proxy: TcpFaultProxy) -> None:
    """Once the clock ran out, the operation asks nothing more of the store: the writers'
    aborts and the claim's removal fail at once (logged), they do not each wait again."""
    backend = _through(proxy, store, deadline_s=2)
    async with Engine(backend=backend, slab_bytes=8 << 20, num_bins=4) as engine:
        await engine.save(_state(0), f"{store.root}/step_0")
        opened = proxy.connections_opened
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(StorageError, match="answered none of this save's requests"):
            await engine.save(_state(1), f"{store.root}/step_1")
        assert time.monotonic() - started < 2 + 4
        assert proxy.connections_opened - opened < 40  # no retry storm after the clock ran out
        proxy.pass_through()


async def test_a_save_reports_what_it_asked_of_the_store(
        store: Store, proxy: TcpFaultProxy) -> None:
    """`SaveResult.store`: requests, retries, bytes and the time spent waiting on the store,
    so a slow save can be blamed on the store or on us."""
    backend = _through(proxy, store, deadline_s=60)  # a busy machine: the resets go on for a while
    state = {"w": torch.randn(24 << 20)}
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        proxy.reset_each_after(1 << 20)  # every part breaks, until 16 MiB have gone up
        task = engine.save(state, f"{store.root}/step_0")
        assert await asyncio.to_thread(proxy.wait_for_bytes_up, proxy.bytes_up + (16 << 20), 30)
        proxy.pass_through()
        asked = (await task).store
        assert asked.num_retries >= 1 and asked.num_requests > asked.num_retries + 4
        assert asked.sent_bytes >= 96 << 20 and asked.received_bytes == 0
        assert asked.num_throttled == 0 and asked.waiting_s > 0
        assert_same(state, await engine.load(f"{store.root}/step_0"))
    local = await _save_locally(state)
    assert local.store == StoreStatistics()


async def _save_locally(state: dict[str, Any]) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        async with Engine() as engine:
            return await engine.save(state, f"{directory}/step_0")


