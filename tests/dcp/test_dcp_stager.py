"""`asynctron.dcp.AsyncStager` (and `StorageWriter.stage`): `dcp.async_save`'s staged copy is
exact, untouched by later changes, bounded by its budget, and its slabs go back to the
process-wide cache once the save that held it ends."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager as DcpAsyncStager

import asynctron
from asynctron.dcp import AsyncStager, StorageReader, StorageWriter
from asynctron.dcp._runtime import plugin_config, runtime_for
from tests.conftest import assert_same
from tests.dcp.test_dcp_writer import load_with, state

BUDGET = {"memory_budget_bytes": 8 << 20, "slab_bytes": 256 << 10}


def borrowed(options: dict[str, Any]) -> int:
    """Bytes the stagers with these options hold, once releases queued so far are done."""
    runtime = runtime_for(plugin_config("test", options))
    runtime.call(asyncio.sleep(0))  # runs after the releases already queued on the loop
    return runtime.staging_budget.borrowed_bytes


class Marked(torch.Tensor):
    pass


def test_the_staged_copy_is_exact_and_later_changes_do_not_reach_it() -> None:
    original = state(5)
    original["array"] = np.arange(6)
    expected = {key: value for key, value in original.items()}
    snapshot = {"model": {k: v.clone() for k, v in original["model"].items()},
                "array": original["array"].copy()}
    staged = AsyncStager(**BUDGET).stage(original)
    assert_same(original, staged)
    for tensor in original["model"].values():
        if tensor.numel():
            tensor.zero_() if tensor.dtype != torch.bool else tensor.fill_(False)
    original["array"][:] = 0
    assert_same(snapshot["model"], staged["model"])
    assert_same(snapshot["array"], staged["array"])
    assert staged["model"]["w"].data_ptr() != expected["model"]["w"].data_ptr()
    assert all(t.device.type == "cpu" for t in staged["model"].values())


def test_tensors_copied_with_torch_are_staged_exactly() -> None:
    """Leaves torch copies (CUDA ones on a GPU; conjugate and strided CPU ones here): each
    contiguous one into one typed view of its slab, the others through their own views."""
    g = torch.Generator().manual_seed(1)
    source = {f"c{i}": torch.randn(3, 4, dtype=torch.complex64, generator=g).conj()
              for i in range(50)}
    source["big"] = torch.randn(300, 120, dtype=torch.complex64, generator=g).conj()
    source["t"] = torch.randn(5, 7, generator=g).t()
    staged = AsyncStager(**BUDGET).stage(source)
    assert_same({key: value.resolve_conj() for key, value in source.items()}, staged)


def test_slabs_return_to_the_cache_when_the_copy_is_freed() -> None:
    options = {"memory_budget_bytes": 6 << 20, "slab_bytes": 128 << 10}
    stager = AsyncStager(**options)
    source = {"a": torch.randn(1 << 18), "small": [torch.randn(10) for _ in range(50)]}
    staged = stager.stage(source)
    assert borrowed(options) > 1 << 20
    view = staged["a"][10:20]  # a view keeps its slab
    del staged
    gc.collect()
    assert borrowed(options) == 1 << 20  # the small tensors' slab went back; a's is viewed
    del view
    assert borrowed(options) == 0
    reused = asynctron.staging_statistics().num_reused
    stager.stage(source)  # the same sizes again: warm slabs from the cache
    assert asynctron.staging_statistics().num_reused > reused
    assert borrowed(options) == 0


def test_a_state_dict_larger_than_the_budget_is_staged_not_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    options = {"memory_budget_bytes": 1 << 20, "slab_bytes": 64 << 10}
    stager = AsyncStager(**options)
    source = {"w": torch.randn(1 << 19)}  # 2 MiB: twice the budget
    staged = stager.stage(source)  # lent alone: nothing else is staged
    assert_same(source, staged)
    assert borrowed(options) >= 2 << 20
    with caplog.at_level("WARNING", logger="asynctron.dcp._stager"):
        again = stager.stage(source)  # the first copy is held: staged outside the budget
    assert_same(source, again)
    assert "outside memory_budget_bytes (1048576)" in caplog.text
    del staged, again
    gc.collect()
    assert borrowed(options) == 0


def test_a_kept_failed_save_does_not_block_the_next_stage(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # The failed save's exception, kept by the trainer, holds the staged copy through its
    # traceback; the next save must not wait for it (it used to wait forever).
    options = {"memory_budget_bytes": 12 << 20, "slab_bytes": 1 << 20}
    source = {"a": torch.randn(2 << 20)}  # 8 MiB: one staged copy fits the budget, two do not
    os.makedirs(f"{tmp_path}/exists")
    with pytest.raises(CheckpointException) as kept:
        dcp.async_save(source, storage_writer=StorageWriter(f"{tmp_path}/exists",
                                                            **options)).result()
    gc.collect()
    assert borrowed(options) > 0  # held by the kept exception
    done = threading.Event()
    failures: list[BaseException] = []

    def second() -> None:
        try:
            dcp.async_save(source, storage_writer=StorageWriter(f"{tmp_path}/ok",
                                                                **options)).result()
        except BaseException as error:  # reported by the assertion below
            failures.append(error)
        done.set()

    with caplog.at_level("WARNING", logger="asynctron.dcp._stager"):
        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        thread.join(120)  # a bound for the hang this guards against, not a timing check
    assert done.is_set() and not failures, failures
    assert "still held by earlier staged copies" in caplog.text
    assert_same(source, load_with(StorageReader(f"{tmp_path}/ok"), source))
    del kept
    gc.collect()
    assert borrowed(options) == 0


def test_unknown_tensor_types_and_options_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"tensor at key 'm.x': expected a tensor or DTensor, "
                                        r"found .*Marked"):
        AsyncStager().stage({"m": {"x": torch.zeros(2).as_subclass(Marked)}})
    with pytest.raises(ValueError, match=r"AsyncStager: unknown option 'job'"):
        AsyncStager(job="x")


def test_a_blocking_call_on_the_runtimes_own_loop_thread_is_refused() -> None:
    """A plugin call made from the runtime's loop would wait for itself: refused, not run."""
    runtime = runtime_for(plugin_config("test", BUDGET))
    ran = []

    async def inner() -> None:
        ran.append(True)

    async def nested() -> None:
        runtime.call(inner())

    with pytest.raises(RuntimeError, match=r"^asynctron.dcp plugin: called on its own loop "
                                           r"thread \(asynctron-dcp\)"):
        runtime.call(nested())
    assert not ran


def test_async_save_with_the_stager_and_a_stock_writer(tmp_path: Any) -> None:
    expected = state(6)
    copy = {"model": {k: v.clone() for k, v in expected["model"].items()}}
    future = dcp.async_save(expected, storage_writer=dcp.FileSystemWriter(f"{tmp_path}/c"),
                            async_stager=AsyncStager(**BUDGET))
    for tensor in expected["model"].values():  # training goes on while the save runs
        tensor.add_(1) if tensor.dtype not in (torch.bool,) else None
    future.result()
    loaded = load_with(dcp.FileSystemReader(f"{tmp_path}/c"), expected)
    assert_same(copy["model"], loaded["model"])
    del future, loaded
    assert borrowed(BUDGET) == 0


def test_async_save_with_the_writer_stages_on_asynctron(tmp_path: Any) -> None:
    writer = StorageWriter(f"{tmp_path}/c")
    assert isinstance(writer, DcpAsyncStager)  # so async_save uses it when no stager is given
    expected = state(7)
    future = dcp.async_save(expected, storage_writer=writer)
    future.result()
    assert_same(expected, load_with(StorageReader(f"{tmp_path}/c"), expected))
    assert_same(expected, load_with(dcp.FileSystemReader(f"{tmp_path}/c"), expected))
    assert sorted(os.listdir(tmp_path)) == ["c"]
    del future
    assert borrowed({}) == 0  # the writer's stager (default options) holds nothing now
