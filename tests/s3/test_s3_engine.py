"""Checkpoints on a real S3-compatible server: every entry point a local path has, the commit
protocol's promises (manifest last, nothing else under a root, keep_last), clear errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import asynctron
from asynctron import BackgroundEngine, Engine
from asynctron.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from asynctron.storage.backends.s3 import S3Backend, S3Config
from asynctron.testing import LoopWatchdog
from asynctron.testing.seaweedfs import SeaweedFS
from tests.conftest import assert_same
from tests.s3.conftest import keys_under, uploads_under


def _state(seed: int = 1) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(3 << 20), "b": torch.arange(1000)},
            "small": [torch.full((5,), float(i)) for i in range(40)],
            "optim": {"step": 3, "lr": 1e-3, "name": "adam"}}


async def test_save_load_and_latest_round_trip(s3_root: str, s3_objects: Any) -> None:
    state = _state()
    async with Engine(slab_bytes=8 << 20) as engine, LoopWatchdog() as dog:
        result = await engine.save(state, f"{s3_root}/step_1")
        assert result.path == f"{s3_root}/step_1"
        assert_same(state, await engine.load(f"{s3_root}/step_1"))
        assert_same(state, await engine.load(s3_root))  # follows latest
        target = {"model": {"w": torch.empty(3 << 20), "b": torch.empty(1000, dtype=torch.long)},
                  "small": [torch.empty(5) for _ in range(40)],
                  "optim": {"step": 0, "lr": 0.0, "name": ""}}
        assert_same(state, await engine.load_into(target, s3_root))
        assert_same(state["model"], target["model"])
    print(f"worst loop delay during an S3 save and loads: "
          f"{dog.report().worst_delay_s * 1e3:.1f} ms")
    assert sorted(keys_under(s3_objects, s3_root)) == [
        "latest", "step_1/__0_0.distcp", "step_1/__0_1.distcp", "step_1/manifest.json"]
    assert uploads_under(s3_objects, s3_root) == []


def test_one_call_save_and_load(s3_root: str) -> None:
    state = _state()
    asynctron.save(state, f"{s3_root}/one")
    assert_same(state, asynctron.load(f"{s3_root}/one"))


def test_background_engine(s3_root: str) -> None:
    state = _state()
    with BackgroundEngine() as engine:
        engine.save(state, f"{s3_root}/bg").result()
        assert_same(state, engine.load(f"{s3_root}/bg"))


async def test_keep_last_leaves_exactly_the_retained_checkpoints(s3_root: str,
                                                                 s3_objects: Any) -> None:
    async with Engine(keep_last=2, job="run") as engine:
        for step in range(5):
            await engine.save(_state(step), f"{s3_root}/step_{step}")
        assert_same(_state(4)["model"], (await engine.load(s3_root))["model"])
    assert keys_under(s3_objects, s3_root) == [
        ".asynctron-ledger", "latest",
        "step_3/__0_0.distcp", "step_3/__0_1.distcp", "step_3/manifest.json",
        "step_4/__0_0.distcp", "step_4/__0_1.distcp", "step_4/manifest.json"]


async def test_keep_last_never_deletes_what_its_job_did_not_commit(s3_root: str,
                                                                    s3_objects: Any) -> None:
    async with Engine() as engine:
        await engine.save(_state(), f"{s3_root}/by_hand")
    async with Engine(keep_last=1, job="run") as engine:
        for step in range(3):
            await engine.save(_state(), f"{s3_root}/step_{step}")
    names = {key.split("/")[0] for key in keys_under(s3_objects, s3_root)}
    assert names == {".asynctron-ledger", "latest", "by_hand", "step_2"}


async def test_an_existing_checkpoint_is_never_overwritten(s3_root: str) -> None:
    async with Engine() as engine:
        await engine.save(_state(), f"{s3_root}/step_1")
        with pytest.raises(FileExistsError, match="step_1"):
            await engine.save(_state(2), f"{s3_root}/step_1")
        assert_same(_state()["optim"], (await engine.load(f"{s3_root}/step_1"))["optim"])


async def test_missing_checkpoint_and_bucket_are_named(s3_root: str, s3_env: SeaweedFS) -> None:
    async with Engine() as engine:
        with pytest.raises(CheckpointNotFoundError, match="nothing_here"):
            await engine.load(f"{s3_root}/nothing_here")
        with pytest.raises(StorageError, match=r"no-such-bucket.*does not exist"):
            await engine.save(_state(), "s3://no-such-bucket/run/step_1")


async def test_wrong_credentials_say_what_to_set(s3_root: str, s3_env: SeaweedFS) -> None:
    backend = S3Backend(S3Config(endpoint_url=s3_env.endpoint, access_key_id="wrong",
                                 secret_access_key="wrong", deadline_s=5))
    async with Engine(backend=backend) as engine:
        with pytest.raises(StorageError) as caught:
            await engine.save(_state(), f"{s3_root}/step_1")
    message = str(caught.value)
    assert s3_env.endpoint in message and "AWS_ACCESS_KEY_ID" in message


async def test_mmap_on_a_store_says_what_to_do_instead(s3_root: str) -> None:
    async with Engine() as engine:
        await engine.save(_state(), f"{s3_root}/step_1")
        with pytest.raises(StorageError, match="mmap=False"):
            await engine.load(f"{s3_root}/step_1", mmap=True)


@pytest.mark.parametrize("url", ["s3://", "s3://bucket", "s3://bucket/a//b", "s3://b/../x"])
async def test_malformed_urls_are_refused_by_name(url: str, s3_env: SeaweedFS) -> None:
    async with Engine() as engine:
        with pytest.raises(ValueError, match="expected s3://bucket/"):
            await engine.save(_state(), url)


def test_flipped_and_truncated_objects_are_caught_on_load(s3_root: str,
                                                                s3_objects: Any) -> None:
    state = {"w": torch.randn(1 << 20), "v": torch.randn(1000)}
    asynctron.save(state, f"{s3_root}/flip", num_bins=1)
    asynctron.save(state, f"{s3_root}/cut", num_bins=1)
    bucket, _, prefix = s3_root[5:].partition("/")
    for name, change in (("flip", lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:]),
                         ("cut", lambda data: data[: len(data) // 2])):
        key = f"{prefix}/{name}/__0_0.distcp"
        data = s3_objects.get_object(Bucket=bucket, Key=key)["Body"].read()
        s3_objects.put_object(Bucket=bucket, Key=key, Body=change(data))
        with pytest.raises(CorruptCheckpointError, match=f"{name}/__0_0.distcp"):
            asynctron.load(f"{s3_root}/{name}")


@pytest.mark.parametrize("options", [{"sign_payload": True}, {"store_checksums": True}])
async def test_signed_payloads_and_store_checksums_are_options_that_work(
        s3_root: str, options: dict[str, bool]) -> None:
    backend = S3Backend(S3Config(**options))
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(), f"{s3_root}/step_1")
        assert_same(_state(), await engine.load(f"{s3_root}/step_1"))


def test_s3_urls_go_to_the_s3_backend_and_never_to_a_local_path(tmp_path: Any,
                                                                 monkeypatch: Any) -> None:
    from asynctron.datasets import IndexedDataset
    from asynctron.storage.backends import backend_for

    assert isinstance(backend_for("s3://bucket/run"), S3Backend)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="expected object_storage_config"):
        IndexedDataset("s3://bucket/corpus", mmap=False)
    assert list(tmp_path.iterdir()) == []


def test_the_jobs_request_budget_is_shared_by_its_processes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert S3Config(max_requests=64).process_requests(8) == 64
    assert S3Config(max_requests=64, job_max_requests=100).process_requests(8) == 12
    assert S3Config(max_requests=8, job_max_requests=100).process_requests(2) == 8
    assert S3Config(job_max_requests=4).process_requests(16) == 1  # never none
    monkeypatch.setenv("ASYNCTRON_STORE_JOB_REQUESTS", "32")
    assert S3Config().process_requests(4) == 8
    monkeypatch.setenv("ASYNCTRON_STORE_JOB_REQUESTS", "lots")
    with pytest.raises(ValueError, match=r"ASYNCTRON_STORE_JOB_REQUESTS.*'lots'"):
        S3Config()
    with pytest.raises(ValueError, match="job_max_requests: expected a positive int"):
        S3Config(job_max_requests=0)
