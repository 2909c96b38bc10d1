"""`asynctron.dcp.StorageReader`: reads stock DCP checkpoints and its writer's bit-exactly;
refuses hostile or damaged checkpoints by name before reading a byte, and items whose bytes
changed after commit."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import re
import weakref
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import asynctron
from asynctron import CheckpointNotFoundError, CorruptCheckpointError
from asynctron.dcp import StorageReader, StorageWriter, _read_job
from tests.conftest import assert_same
from tests.dcp.test_dcp_writer import load_with, state


class Payload:
    """A value stock DCP pickles as an object: loading must refuse it, not run it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getcwd, ())


def test_reads_stock_checkpoints_of_one_file_per_item(tmp_path: Any) -> None:
    expected = state(4)
    path = f"{tmp_path}/stock"
    dcp.save(expected, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=False))
    assert_same(expected, load_with(StorageReader(path), expected))


def test_loads_into_another_dtype_as_stock_does(tmp_path: Any) -> None:
    saved = {"w": torch.randn(6, 4)}
    dcp.save(saved, storage_writer=StorageWriter(f"{tmp_path}/c"))
    target = {"w": torch.zeros(6, 4, dtype=torch.float64)}
    dcp.load(target, storage_reader=StorageReader(f"{tmp_path}/c"))
    assert torch.equal(target["w"], saved["w"].double())


@pytest.mark.parametrize(("writer", "dtype"), [
    (dcp.FileSystemWriter, torch.float32),  # torch.save blobs, read apart
    (StorageWriter, torch.float64),  # raw chunks read apart (converted into the targets)
    (StorageWriter, torch.float32),  # raw chunks straight into the targets: nothing apart
], ids=["stock blobs", "raw converted", "raw direct"])
def test_temporary_buffers_are_bounded_by_the_budget(tmp_path: Any, monkeypatch: Any,
                                                     writer: Any, dtype: torch.dtype) -> None:
    """The reader holds what it reads apart from its targets in waves of at most
    `memory_budget_bytes` (one larger item alone), not the rank's whole share at once."""
    saved = {f"w{i}": torch.randn(64, 1024) for i in range(8)}  # 256 KiB each
    saved["big"] = torch.randn(1024, 1024)  # 4 MiB: more than the budget
    dcp.save(saved, storage_writer=writer(f"{tmp_path}/c"))
    live: dict[int, int] = {}
    peaks: list[int] = []

    def temporary(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        live[id(buffer)] = buffer.numel() * buffer.element_size()
        weakref.finalize(buffer, live.pop, id(buffer))
        peaks.append(sum(live.values()))
        return buffer

    monkeypatch.setattr(_read_job, "_temporary", temporary)
    budget = 600 << 10
    target = {key: torch.zeros(value.shape, dtype=dtype) for key, value in saved.items()}
    dcp.load(target, storage_reader=StorageReader(f"{tmp_path}/c", memory_budget_bytes=budget,
                                                  slab_bytes=64 << 10))
    for key, value in saved.items():
        assert torch.equal(target[key], value.to(dtype)), key
    assert not live  # every buffer freed
    if dtype == torch.float32 and writer is StorageWriter:
        assert peaks == []
        return
    assert len(peaks) == 9
    *small, big = sorted(peaks)
    assert (4 << 20) <= big < (4 << 20) + (16 << 10), peaks  # the big item, alone
    assert max(small) <= budget, peaks


def test_a_missing_checkpoint_is_named(tmp_path: Any,
                                       caplog: pytest.LogCaptureFixture) -> None:
    """The user sees the path and the reason on every torch: in `dcp.load`'s error from torch
    2.12 on; before, where `dcp.load` drops the reader's error, in the reader's warning."""
    named = r"checkpoint .*/nothing: expected a committed checkpoint"
    reader = StorageReader(f"{tmp_path}/nothing")
    with pytest.raises(CheckpointNotFoundError, match=named):
        reader.read_metadata()
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointException) as raised:
        dcp.load({"w": torch.zeros(1)}, storage_reader=reader)
    logged = [record.getMessage() for record in caplog.records
              if record.name.startswith("asynctron")]
    if torch.__version__ < (2, 12):
        assert len(logged) == 1 and re.search(f"CheckpointNotFoundError: {named}", logged[0])
    else:
        assert re.search(named, str(raised.value))
        assert logged == []


def test_stock_dcp_load_reads_an_asynctron_format_checkpoint(tmp_path: Any) -> None:
    """Its DCP metadata is made from its manifest: tensors (a chunked one too), bytes, an
    ndarray and the structure's JSON values come back as `dcp.load` of a DCP save would."""
    big = torch.arange(1 << 22, dtype=torch.float32).reshape(1 << 12, 1 << 10)
    saved = {"model": {"w": torch.ones(2), "big": big}, "blob": b"\x00\xffbytes",
             "array": np.arange(6, dtype=np.int16).reshape(2, 3),
             "meta": {"step": 7, "name": "run", "betas": [0.9, 0.99]}}
    asynctron.save(saved, f"{tmp_path}/native", num_bins=4)
    target = {"model": {"w": torch.zeros(2), "big": torch.zeros_like(big)}, "blob": b"",
              "array": np.zeros((2, 3), dtype=np.int16),
              "meta": {"step": 0, "name": "", "betas": [0.0, 0.0]}}
    dcp.load(target, storage_reader=StorageReader(f"{tmp_path}/native"))
    assert torch.equal(target["model"]["w"], saved["model"]["w"])
    assert torch.equal(target["model"]["big"], big)
    assert target["blob"] == saved["blob"] and np.array_equal(target["array"], saved["array"])
    assert target["meta"] == saved["meta"]


@pytest.mark.parametrize(("content", "message"), [
    (b"not a pickle at all", r"metadata .*\.metadata: "),
    (pickle.dumps(Payload()), r"expected only DCP metadata types, found global posix\.getcwd"),
    (pickle.dumps({"a": 1}), r"expected a pickled Metadata, found dict"),
])
def test_a_corrupt_or_hostile_metadata_is_refused_unrun(tmp_path: Any, content: bytes,
                                                         message: str) -> None:
    for writer in (dcp.FileSystemWriter, StorageWriter):
        path = f"{tmp_path}/{writer.__name__}"
        dcp.save({"w": torch.ones(2)}, storage_writer=writer(path))
        with open(f"{path}/.metadata", "wb") as f:
            f.write(content)
        with pytest.raises(CorruptCheckpointError, match=message):
            StorageReader(path).read_metadata()


def test_a_truncated_file_is_named_before_any_read(tmp_path: Any) -> None:
    path = f"{tmp_path}/c"
    dcp.save({"w": torch.randn(1000)}, storage_writer=StorageWriter(path, num_bins=1))
    os.truncate(f"{path}/__0_0.distcp", 100)
    with pytest.raises(CorruptCheckpointError, match=r"file .*__0_0\.distcp: expected \d+ "
                                                     r"bytes, found 100; items \['w'\] are cut"):
        StorageReader(path).read_metadata()


def test_changed_bytes_fail_their_digest(tmp_path: Any) -> None:
    """Stock DCP would load the changed value; the reader names the item, file and offset."""
    path = f"{tmp_path}/c"
    expected = {"w": torch.zeros(4096), "b": torch.ones(3)}
    dcp.save(expected, storage_writer=StorageWriter(path, num_bins=1))
    data_file = f"{path}/__0_0.distcp"
    with open(data_file, "r+b") as f:
        content = f.read()
        at = content.index(bytes(4096))  # inside w's zeros
        f.seek(at + 100)
        f.write(b"\x01")
    with pytest.raises(CheckpointException, match=r"item 'w' in .*__0_0\.distcp at offset \d+: "
                                                  r"expected xxh3_64"):
        load_with(StorageReader(path), expected)
    assert load_with(StorageReader(path, verify=False), expected)["w"].count_nonzero() == 1


@pytest.mark.usefixtures("default_safe_globals")
def test_a_pickled_object_is_refused_not_run(tmp_path: Any) -> None:
    """Stock DCP's planner loads pickled values with `weights_only=False`: the reader checks
    the blob first, and refuses a foreign global by naming the item."""
    path = f"{tmp_path}/stock"
    dcp.save({"w": torch.ones(2), "obj": Payload()}, storage_writer=dcp.FileSystemWriter(path))
    with pytest.raises(CheckpointException, match=r"item 'obj' in .*: holds \w+\.getcwd, which "
                                                  r"asynctron does not unpickle"):
        dcp.load({"w": torch.zeros(2), "obj": None}, storage_reader=StorageReader(path))


@pytest.mark.parametrize("writer", [dcp.FileSystemWriter, StorageWriter])
def test_numpy_values_round_trip(tmp_path: Any, writer: Any) -> None:
    """What stock DCP saves of numpy (an RNG state, scalars, arrays) the reader loads."""
    expected = {"w": torch.ones(2), "rng": np.random.RandomState(3).get_state(),
                "loss": np.float64(0.25), "step": np.int64(7),
                "mask": np.arange(3, dtype=np.uint32)}
    dcp.save(expected, storage_writer=writer(f"{tmp_path}/c"))
    loaded: dict[str, Any] = {"w": torch.zeros(2), "rng": None, "loss": None, "step": None,
                              "mask": None}
    dcp.load(loaded, storage_reader=StorageReader(f"{tmp_path}/c"))
    assert loaded["rng"][0] == "MT19937" and loaded["rng"][2:] == expected["rng"][2:]
    np.testing.assert_array_equal(loaded["rng"][1], expected["rng"][1])
    assert type(loaded["loss"]) is np.float64 and loaded["loss"] == 0.25
    assert type(loaded["step"]) is np.int64 and loaded["step"] == 7
    np.testing.assert_array_equal(loaded["mask"], expected["mask"])


@pytest.mark.usefixtures("default_safe_globals")
def test_a_refused_value_names_its_key_and_add_safe_globals(tmp_path: Any) -> None:
    """A value stock DCP saves but asynctron does not unpickle: refused by name, not as
    damage; `torch.serialization.add_safe_globals` (here its context form) admits it."""
    path = f"{tmp_path}/stock"
    when = datetime.datetime(2020, 1, 2)
    dcp.save({"w": torch.ones(2), "when": when}, storage_writer=dcp.FileSystemWriter(path))
    with pytest.raises(CheckpointException, match=r"item 'when' in .*: holds datetime\.datetime, "
                                                  r"which asynctron does not unpickle .*not "
                                                  r"damaged.*add_safe_globals"):
        dcp.load({"w": torch.zeros(2), "when": None}, storage_reader=StorageReader(path))
    loaded: dict[str, Any] = {"w": torch.zeros(2), "when": None}
    with torch.serialization.safe_globals([datetime.datetime]):
        dcp.load(loaded, storage_reader=StorageReader(path))
    assert loaded["when"] == when


def test_a_target_of_another_shape_is_refused_by_dcp(tmp_path: Any) -> None:
    dcp.save({"w": torch.ones(4)}, storage_writer=StorageWriter(f"{tmp_path}/c"))
    with pytest.raises(CheckpointException, match=r"[Ss]ize mismatch|shape"):
        dcp.load({"w": torch.zeros(5)}, storage_reader=StorageReader(f"{tmp_path}/c"))
