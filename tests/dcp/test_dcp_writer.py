"""`asynctron.dcp.StorageWriter` on one process: what it writes, stock DCP reads bit-exactly
(and asynctron's own loader, verifying digests); a failed save leaves nothing at its path and
the previous checkpoint intact; bad paths and options are refused by name."""

from __future__ import annotations

import datetime
import errno
import json
import os
import pickle
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import asynctron
from asynctron.dcp import StorageReader, StorageWriter
from asynctron.testing import FaultyBackend
from tests.conftest import assert_same

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


def state(seed: int = 0) -> dict[str, Any]:
    """Every kind of leaf DCP saves: tensors of many dtypes (strided, 0-d, empty, one large
    enough to be cut into chunks), nested dicts and lists, pickled values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(300, 40, generator=g),
            "bf16": torch.randn(17, 3, generator=g).to(torch.bfloat16),
            "i8": torch.randint(-100, 100, (33,), dtype=torch.int8, generator=g),
            "mask": torch.rand(9, 2, generator=g) > 0.5,
            "c64": torch.randn(5, dtype=torch.complex64, generator=g),
            "t": torch.randn(12, 7, generator=g).t(),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "big": torch.randn(600, 256, generator=g),
        },
        "optim": {"state": {"0": {"exp_avg": torch.randn(40, generator=g), "step": 7}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "step": 12,
        "note": "hello",
        "layers": [torch.full((4,), float(i)) for i in range(3)],
    }


def zeros_like(value: Any) -> Any:
    """A load target of the same structure: tensors zeroed, other values emptied."""
    if isinstance(value, dict):
        return {key: zeros_like(item) for key, item in value.items()}
    if isinstance(value, list):
        return [zeros_like(item) for item in value]
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value.contiguous())
    return None


def load_with(reader: Any, expected: dict[str, Any]) -> dict[str, Any]:
    target = zeros_like(expected)
    dcp.load(target, storage_reader=reader)
    return target


def leftovers(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if ".tmp-" in name)


def test_stock_reader_reads_what_it_writes_bit_exactly(tmp_path: Any) -> None:
    expected = state()
    path = f"{tmp_path}/ckpt"
    metadata = dcp.save(expected, storage_writer=StorageWriter(path, num_bins=3, **SMALL))
    assert_same(expected, load_with(dcp.FileSystemReader(path), expected))
    assert_same(expected, load_with(StorageReader(path), expected))
    names = sorted(os.listdir(path))
    assert names[:2] == [".metadata", "__0_0.distcp"] and names[-1] == "manifest.json"
    assert leftovers(str(tmp_path)) == []
    assert metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id == path


def test_a_large_tensor_is_cut_into_chunks_over_the_bins(shm_path: str) -> None:
    """A tensor larger than its share of the bins is written as dim-0 chunks, one per writer;
    the metadata `dcp.save` returns (and `.metadata`) lists them, as a sharded tensor's."""
    expected = {"emb": torch.randn(40 << 10, 256), "b": torch.randn(7)}  # 40 MiB
    path = f"{shm_path}/ckpt"
    metadata = dcp.save(expected, storage_writer=StorageWriter(path, num_bins=2))
    assert len(metadata.state_dict_metadata["emb"].chunks) == 2
    assert_same(expected, load_with(dcp.FileSystemReader(path), expected))
    assert_same(expected, load_with(StorageReader(path), expected))


def test_asynctron_loader_reads_it_and_checks_digests(tmp_path: Any) -> None:
    expected = {"w": torch.randn(64, 64), "nested": {"b": torch.arange(10)}, "step": 3}
    path = f"{tmp_path}/ckpt"
    dcp.save(expected, storage_writer=StorageWriter(path))
    with open(f"{path}/manifest.json") as f:
        manifest = json.load(f)
    assert manifest["checksum"] == "xxh3_64"
    assert all(item["checksum"] for item in manifest["items"])
    assert_same(expected, asynctron.load(path))


def test_reads_what_stock_writer_writes(tmp_path: Any) -> None:
    expected = state(1)
    path = f"{tmp_path}/stock"
    dcp.save(expected, storage_writer=dcp.FileSystemWriter(path, thread_count=2))
    assert_same(expected, load_with(StorageReader(path), expected))


def test_nothing_is_written_without_checksums_when_asked(tmp_path: Any) -> None:
    expected = {"w": torch.randn(10)}
    dcp.save(expected, storage_writer=StorageWriter(f"{tmp_path}/c", checksum=None))
    with open(f"{tmp_path}/c/manifest.json") as f:
        assert json.load(f)["checksum"] is None
    assert_same(expected, load_with(dcp.FileSystemReader(f"{tmp_path}/c"), expected))


def test_checkpoint_id_replaces_the_path(tmp_path: Any) -> None:
    writer = StorageWriter(f"{tmp_path}/unused")
    expected = {"w": torch.randn(5)}
    dcp.save(expected, storage_writer=writer, checkpoint_id=f"{tmp_path}/step_1")
    dcp.save(expected, storage_writer=writer, checkpoint_id=f"{tmp_path}/step_2")
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]
    reader = StorageReader(f"{tmp_path}/unused")
    target = zeros_like(expected)
    dcp.load(target, storage_reader=reader, checkpoint_id=f"{tmp_path}/step_2")
    assert_same(expected, target)


@pytest.mark.parametrize(("fault", "code"), [
    ({"enospc_after_bytes": 100 << 10}, errno.ENOSPC),
    ({"fail_fsync": True}, errno.EIO),
])
def test_failed_save_leaves_no_checkpoint_and_keeps_the_previous(
        tmp_path: Any, fault: dict[str, Any], code: int) -> None:
    """A save that fails mid-write (ENOSPC after some bytes, or a failing fsync) raises DCP's
    CheckpointException naming the file and errno; nothing appears at its path; the previous
    checkpoint still loads bit-exactly; the tmp dir goes once the writer is reset or closed."""
    good = state(2)
    dcp.save(good, storage_writer=StorageWriter(f"{tmp_path}/step_1", **SMALL))
    writer = StorageWriter(f"{tmp_path}/step_2", backend=FaultyBackend(**fault), **SMALL)
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state(3), storage_writer=writer)
    ((failure, _),) = raised.value.failures.values()  # DCP keeps (error, traceback)
    assert isinstance(failure, asynctron.StorageError) and failure.errno == code
    assert ".tmp-" in failure.path and os.path.basename(failure.path).endswith(".distcp")
    assert not os.path.exists(f"{tmp_path}/step_2")
    assert_same(good, load_with(StorageReader(f"{tmp_path}/step_1"), good))
    assert len(leftovers(str(tmp_path))) == 1  # held by the writer until reset or closed
    writer.close()
    assert leftovers(str(tmp_path)) == [] and sorted(os.listdir(tmp_path)) == ["step_1"]


def test_reset_removes_the_failed_saves_tmp_dir(tmp_path: Any) -> None:
    faulty = FaultyBackend(enospc_after_bytes=0)
    writer = StorageWriter(f"{tmp_path}/a", backend=faulty)
    with pytest.raises(CheckpointException):
        dcp.save({"w": torch.randn(1000)}, storage_writer=writer)
    faulty.enospc_after_bytes = None
    dcp.save({"w": torch.ones(3)}, storage_writer=writer, checkpoint_id=f"{tmp_path}/b")
    assert sorted(os.listdir(tmp_path)) == ["b"]


def test_an_existing_path_is_never_overwritten(tmp_path: Any) -> None:
    dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(f"{tmp_path}/c"))
    with pytest.raises(CheckpointException, match=r"checkpoint .*/c: expected a new path, "
                                                  r"found an existing one"):
        dcp.save({"w": torch.zeros(3)}, storage_writer=StorageWriter(f"{tmp_path}/c"))
    assert_same({"w": torch.ones(3)},
                load_with(dcp.FileSystemReader(f"{tmp_path}/c"), {"w": torch.ones(3)}))
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(CheckpointException, match=r"checkpoint .*/file: expected a new path"):
        dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(f"{tmp_path}/file"))
    with pytest.raises(CheckpointException, match=r"file"):
        dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(f"{tmp_path}/file/sub"))
    assert leftovers(str(tmp_path)) == []


def test_bad_options_and_paths_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"StorageWriter: unknown option 'keep_last'"):
        StorageWriter("/tmp/x", keep_last=2)
    with pytest.raises(ValueError, match=r"num_bins: expected an int >= 1, found 0"):
        StorageWriter("/tmp/x", num_bins=0)
    with pytest.raises(TypeError, match=r"StorageWriter path: expected a str or os.PathLike, "
                                        r"found int"):
        StorageWriter(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"StorageReader path: expected a non-empty"):
        StorageReader("")


def test_use_collectives_false_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"use_collectives=False"):
        dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(f"{tmp_path}/c"),
                 use_collectives=False)
    assert not os.path.exists(f"{tmp_path}/c")


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_unsupported_dtype_names_the_key(tmp_path: Any) -> None:
    with pytest.raises(CheckpointException, match=r"'q'.*complex32"):
        dcp.save({"w": torch.ones(2), "q": torch.zeros(2, dtype=torch.complex32)},
                 storage_writer=StorageWriter(f"{tmp_path}/c"))
    assert not os.path.exists(f"{tmp_path}/c")


@pytest.mark.usefixtures("default_safe_globals")
def test_a_value_its_reader_would_refuse_is_refused_at_save_time(tmp_path: Any) -> None:
    """What StorageWriter writes, StorageReader reads: a pickled value holding a class the
    reader does not unpickle fails the save, naming the key, and nothing is written; numpy
    scalars, which the reader admits, save."""
    with pytest.raises(CheckpointException, match=r"'when'.*add_safe_globals"):
        dcp.save({"w": torch.ones(2), "when": datetime.date(2026, 11, 24)},
                 storage_writer=StorageWriter(f"{tmp_path}/c"))
    assert not os.path.exists(f"{tmp_path}/c")
    dcp.save({"w": torch.ones(2), "loss": np.float64(2.5)},
             storage_writer=StorageWriter(f"{tmp_path}/ok"))
    back: dict[str, Any] = {"w": torch.zeros(2), "loss": None}
    dcp.load(back, storage_reader=StorageReader(f"{tmp_path}/ok"))
    assert back["loss"] == 2.5 and torch.equal(back["w"], torch.ones(2))


def test_asynctron_errors_survive_dcps_gather() -> None:
    """DCP pickles every rank's failure to the coordinator: asynctron's errors, built with
    keyword arguments, come back whole (a non-picklable one crashed the coordinator's
    gather with a TypeError instead of raising CheckpointException)."""
    error = asynctron.StorageError("writing 'f' failed: ENOSPC", path="/ckpt/f",
                                   errno=errno.ENOSPC)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is asynctron.StorageError and str(back) == str(error)
    assert (back.path, back.errno) == ("/ckpt/f", errno.ENOSPC)
    missing = pickle.loads(pickle.dumps(asynctron.CheckpointNotFoundError("gone", path="/c")))
    assert isinstance(missing, FileNotFoundError) and str(missing) == "gone"
