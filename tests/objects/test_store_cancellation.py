"""Cancellation on each object store, in the httpcore style: a save, a load or a dataset read
is cancelled while one of its calls is held at a known point (`GatedObjectClient`; in a
loader's worker process, `_HeldInWorkers`), never after a sleep. Each time the caller gets
CancelledError at once, nothing of the cancelled save is visible or left open (no object, no
upload, no claim), the previous checkpoint loads bit for bit, and the same engine saves and
loads (the same loader reads) again: nothing stuck."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from asynctron import Engine
from asynctron._processes import process_exists
from asynctron.datasets import (
    AsyncLoader,
    GPTDatasetConfig,
    IndexedDataset,
    build_gpt_datasets,
    object_cache_usage,
)
from asynctron.storage.backends import register_backend
from asynctron.storage.backends.objects import ObjectClient, ObjectStoreBackend, ObjectUrl
from asynctron.testing import GatedObjectClient
from asynctron.testing._gated_objects import ObjectGatePoint
from tests.conftest import assert_same
from tests.datasets.conftest import Tok
from tests.objects.conftest import Store


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(6 << 20), "v": torch.randn(1000), "step": seed}


def _gated(store: Store) -> tuple[GatedObjectClient, ObjectStoreBackend]:
    client = GatedObjectClient(store.backend(deadline_s=30).client)
    return client, ObjectStoreBackend(client)


SAVE_POINTS: list[tuple[ObjectGatePoint, str]] = [
    ("put", ".asynctron.tmp-"),        # start: the claim is about to be written
    ("upload_part", "step_1/"),        # write: a part is about to go up
    ("complete_upload", "step_1/"),    # write: a file is about to be whole
]


@pytest.mark.parametrize(("point", "key"), SAVE_POINTS, ids=["claim", "part", "complete"])
async def test_a_save_cancelled_at_each_point_leaves_nothing(
        store: Store, point: ObjectGatePoint, key: str) -> None:
    client, backend = _gated(store)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(0), f"{store.root}/step_0")
        gate = client.hold(point, where=lambda url: key in url.key)
        task = engine.save(_state(1), f"{store.root}/step_1")
        await gate.reached()
        task.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert_same(_state(0), await engine.load(store.root))
        names = {name.split("/")[0] for name in store.keys_under(store.root)}
        assert names == {"latest", "step_0"}, names
        assert store.uploads_under(store.root) == []
        await engine.save(_state(2), f"{store.root}/step_1")  # the same path, free again
        assert_same(_state(2), await engine.load(store.root))


async def test_a_save_cancelled_at_its_commit_point_commits_whole_or_not_at_all(
        store: Store) -> None:
    """Once every rank has written, the commit runs to its end (`SaveTask.cancel`): the
    checkpoint is then committed whole, or (cancelled before) not at all."""
    client, backend = _gated(store)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(0), f"{store.root}/step_0")
        gate = client.hold("put", where=lambda url: url.key.endswith("step_1/manifest.json"))
        task = engine.save(_state(1), f"{store.root}/step_1")
        await gate.reached()
        task.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        keys = store.keys_under(store.root)
        if "step_1/manifest.json" in keys:
            assert_same(_state(1), await engine.load(f"{store.root}/step_1"))
        else:
            assert not [key for key in keys if key.startswith("step_1/")], keys
        assert not [key for key in keys if key.startswith(".step_1")], keys
        assert store.uploads_under(store.root) == []
        assert_same(_state(0), await engine.load(f"{store.root}/step_0"))
        await engine.save(_state(2), f"{store.root}/step_2")
        assert_same(_state(2), await engine.load(store.root))


async def test_a_load_cancelled_mid_read_leaves_nothing_stuck(store: Store) -> None:
    client, backend = _gated(store)
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(0), f"{store.root}/step_0")
        gate = client.hold("get_into")
        task = asyncio.ensure_future(engine.load(f"{store.root}/step_0"))
        await gate.reached()
        task.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert_same(_state(0), await engine.load(f"{store.root}/step_0"))


async def test_a_load_cancelled_while_it_finds_the_checkpoint(store: Store) -> None:
    client, backend = _gated(store)
    async with Engine(backend=backend) as engine:
        await engine.save(_state(0), f"{store.root}/step_0")
        gate = client.hold("list")
        task = asyncio.ensure_future(engine.load(store.root))
        await gate.reached()
        task.cancel()
        gate.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert_same(_state(0), await engine.load(store.root))


def _gpt(prefix: str, tmp_path: Any, cache: str | None) -> Any:
    config = GPTDatasetConfig(random_seed=5, sequence_length=64, tokenizer=Tok(),
                              blend=([prefix], None), split="1", mmap_bin_files=False,
                              object_storage_cache_path=str(tmp_path / "objects"),
                              path_to_cache=cache)
    return build_gpt_datasets(config, [None, None, None])[0]


async def _first_batches(dataset: Any, count: int) -> list[dict[str, Any]]:
    async with Engine(num_workers=1) as engine, AsyncLoader(
            dataset, micro_batch_size=4, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 20, num_ready_batches=1, num_workers=0) as loader:
        return [{key: value.clone() for key, value in (await anext(loader)).items()}
                for _ in range(count)]


async def test_a_dataset_read_cancelled_mid_fetch_loses_no_batch_and_leaves_nothing_stuck(
        store: Store, corpus: tuple[IndexedDataset, str], tmp_path: Any) -> None:
    """A loader reading in this process is cancelled while its batch's ranged GET is held:
    CancelledError at once; once the GET goes on, the next call returns that same batch and
    the rest follow right, the loader closes, and the blocks fetched are all in the cache (a
    second loader reads them without a fetch)."""
    local, url = corpus
    expected = await _first_batches(_gpt(local.path_prefix, tmp_path, str(tmp_path / "local")),
                                     3)
    client, backend = _gated(store)
    replaced = register_backend(store.scheme, lambda: backend)
    assert replaced is not None
    try:
        ours = _gpt(url, tmp_path, None)  # the .idx and the GPT indices fetched, ungated
        gate = client.hold("get_into", where=lambda found: found.key.endswith(".bin"))
        async with Engine(num_workers=1) as engine, AsyncLoader(
                ours, micro_batch_size=4, run_blocking=engine.run_blocking,
                prefetch_budget=1 << 20, num_ready_batches=1, num_workers=0) as loader:
            first = asyncio.ensure_future(anext(loader))
            await gate.reached()
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            gate.release()
            batches = [await anext(loader) for _ in range(3)]
        for number, (batch, want) in enumerate(zip(batches, expected, strict=True)):
            assert all(np.array_equal(batch[key].numpy(), want[key].numpy()) for key in want), (
                number)
        fetched = object_cache_usage(str(tmp_path / "objects")).bytes_fetched
        assert fetched > 0
        (again,) = await _first_batches(_gpt(url, tmp_path, None), 1)
        assert all(np.array_equal(again[key].numpy(), expected[0][key].numpy())
                   for key in expected[0])
        assert object_cache_usage(str(tmp_path / "objects")).bytes_fetched == fetched
    finally:
        register_backend(store.scheme, replaced)


class _HeldInWorkers:
    """`client` (every other attribute its own), whose `.bin` ranged GETs made in processes
    forked from this one wait at their start, before any request, until `release`: a gate
    across the fork, where an asyncio one in the worker could not be released by the test."""

    def __init__(self, client: ObjectClient) -> None:
        self.inner = client
        self._parent = os.getpid()
        context = multiprocessing.get_context("fork")
        self._reached, self._released = context.Event(), context.Event()
        self._held_in = context.Value("q", 0)  # the pid of the first GET held

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def reached(self) -> int:
        """Wait until a forked process's GET is held; returns that process's pid."""
        assert await asyncio.to_thread(self._reached.wait, 60), "no GET was held in a worker"
        return int(self._held_in.value)

    def release(self) -> None:
        """Let every held GET (and every later one) go on."""
        self._released.set()

    async def get_into(self, url: ObjectUrl, offset: int, buffers: Sequence[memoryview],
                       **options: Any) -> None:
        if (os.getpid() != self._parent and url.key.endswith(".bin")
                and not self._released.is_set()):
            with self._held_in.get_lock():
                self._held_in.value = self._held_in.value or os.getpid()
            self._reached.set()
            await asyncio.to_thread(self._released.wait)  # off the worker's store I/O loop
        await self.inner.get_into(url, offset, buffers, **options)


async def test_a_dataset_read_cancelled_in_a_worker_process_loses_no_batch_and_leaves_nothing(
        store: Store, corpus: tuple[IndexedDataset, str], tmp_path: Any) -> None:
    """A loader whose batches are read by forked worker processes is cancelled while every
    `.bin` ranged GET of theirs is held: CancelledError at once, nothing consumed; once the
    GETs go on, the next call returns that same batch and the rest follow right (the
    documented `__anext__` cancellation, as in this process), the loader closes with every
    worker gone, and the blocks fetched are all in the cache (a second loader reads them
    without a fetch)."""
    local, url = corpus
    expected = await _first_batches(_gpt(local.path_prefix, tmp_path, str(tmp_path / "local")),
                                     3)
    held = _HeldInWorkers(store.backend(deadline_s=30).client)
    replaced = register_backend(store.scheme, lambda: ObjectStoreBackend(held))
    assert replaced is not None
    try:
        ours = _gpt(url, tmp_path, None)  # the .idx and the GPT indices fetched, in this process
        async with Engine(num_workers=1) as engine, AsyncLoader(
                ours, micro_batch_size=4, run_blocking=engine.run_blocking,
                prefetch_budget=1 << 20, num_ready_batches=2, num_workers=2,
                start_method="fork") as loader:
            pids = loader.worker_pids
            try:
                first = asyncio.ensure_future(anext(loader))
                assert await held.reached() in pids
                assert not first.done()  # its batch cannot be written: no `.bin` byte came
                first.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await first
                assert loader.consumed_samples == 0
            finally:
                held.release()
            batches = [await anext(loader) for _ in range(3)]
            assert loader.consumed_samples == 3 * 4
        assert pids and not any(pid is None or process_exists(pid) for pid in pids), pids
        for number, (batch, want) in enumerate(zip(batches, expected, strict=True)):
            assert all(np.array_equal(batch[key].numpy(), want[key].numpy()) for key in want), (
                number)
        usage = object_cache_usage(str(tmp_path / "objects"))
        assert 0 < usage.bytes_cached <= usage.bytes_fetched and usage.requests > 0, usage
        (again,) = await _first_batches(_gpt(url, tmp_path, None), 1)
        assert all(np.array_equal(again[key].numpy(), expected[0][key].numpy())
                   for key in expected[0])
        assert object_cache_usage(str(tmp_path / "objects")).bytes_fetched == (
            usage.bytes_fetched)
    finally:
        register_backend(store.scheme, replaced)
