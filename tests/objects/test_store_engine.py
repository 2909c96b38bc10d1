"""Checkpoints on each real object store (S3, Azure Blob): every entry point a local path has,
the commit protocol's promises (manifest last, nothing else under a root, keep_last), clear
errors."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch

import asynctron
from asynctron import BackgroundEngine, Engine
from asynctron.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RefusedCredentialsError,
    StorageError,
)
from asynctron.testing import LoopWatchdog
from tests.conftest import assert_same
from tests.objects.conftest import Store


def _state(seed: int = 1) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(3 << 20), "b": torch.arange(1000)},
            "small": [torch.full((5,), float(i)) for i in range(40)],
            "optim": {"step": 3, "lr": 1e-3, "name": "adam"}}


async def test_save_load_and_latest_round_trip(store: Store) -> None:
    state = _state()
    async with Engine(slab_bytes=8 << 20) as engine, LoopWatchdog() as dog:
        result = await engine.save(state, f"{store.root}/step_1")
        assert result.path == f"{store.root}/step_1"
        assert_same(state, await engine.load(f"{store.root}/step_1"))
        assert_same(state, await engine.load(store.root))  # follows latest
        target = {"model": {"w": torch.empty(3 << 20), "b": torch.empty(1000, dtype=torch.long)},
                  "small": [torch.empty(5) for _ in range(40)],
                  "optim": {"step": 0, "lr": 0.0, "name": ""}}
        assert_same(state, await engine.load_into(target, store.root))
        assert_same(state["model"], target["model"])
    print(f"worst loop delay during a {store.scheme} save and loads: "
          f"{dog.report().worst_delay_s * 1e3:.1f} ms")
    assert sorted(store.keys_under(store.root)) == [
        "latest", "step_1/__0_0.distcp", "step_1/__0_1.distcp", "step_1/manifest.json"]
    assert store.uploads_under(store.root) == []


def test_one_call_save_and_load(store: Store) -> None:
    state = _state()
    asynctron.save(state, f"{store.root}/one")
    assert_same(state, asynctron.load(f"{store.root}/one"))


def test_background_engine(store: Store) -> None:
    state = _state()
    with BackgroundEngine() as engine:
        engine.save(state, f"{store.root}/bg").result()
        assert_same(state, engine.load(f"{store.root}/bg"))


async def test_keep_last_leaves_exactly_the_retained_checkpoints(store: Store) -> None:
    async with Engine(keep_last=2, job="run") as engine:
        for step in range(5):
            await engine.save(_state(step), f"{store.root}/step_{step}")
        assert_same(_state(4)["model"], (await engine.load(store.root))["model"])
    assert store.keys_under(store.root) == [
        ".asynctron-ledger", "latest",
        "step_3/__0_0.distcp", "step_3/__0_1.distcp", "step_3/manifest.json",
        "step_4/__0_0.distcp", "step_4/__0_1.distcp", "step_4/manifest.json"]


async def test_keep_last_never_deletes_what_its_job_did_not_commit(store: Store) -> None:
    async with Engine() as engine:
        await engine.save(_state(), f"{store.root}/by_hand")
    async with Engine(keep_last=1, job="run") as engine:
        for step in range(3):
            await engine.save(_state(), f"{store.root}/step_{step}")
    names = {key.split("/")[0] for key in store.keys_under(store.root)}
    assert names == {".asynctron-ledger", "latest", "by_hand", "step_2"}


async def test_an_existing_checkpoint_is_never_overwritten(store: Store) -> None:
    async with Engine() as engine:
        await engine.save(_state(), f"{store.root}/step_1")
        with pytest.raises(FileExistsError, match="step_1"):
            await engine.save(_state(2), f"{store.root}/step_1")
        assert_same(_state()["optim"], (await engine.load(f"{store.root}/step_1"))["optim"])


async def test_missing_checkpoint_and_bucket_are_named(store: Store) -> None:
    async with Engine() as engine:
        with pytest.raises(CheckpointNotFoundError, match=r"nothing_here: expected a committed "
                                                          r"checkpoint, found nothing: no object "
                                                          r"is stored directly under that URL"):
            await engine.load(f"{store.root}/nothing_here")
        store.put(f"{store.root}/uncommitted/__0_0.distcp", b"x")
        with pytest.raises(CheckpointNotFoundError, match=r"uncommitted: expected a committed "
                                                          r"checkpoint .* found neither; the "
                                                          r"save may not have committed$"):
            await engine.load(f"{store.root}/uncommitted")
        with pytest.raises(StorageError, match=r"no-such-bucket.*does not exist"):
            await engine.save(_state(), f"{store.scheme}://no-such-bucket/run/step_1")


async def test_wrong_credentials_say_what_to_set(store: Store) -> None:
    if store.scheme == "gs":
        pytest.skip("fake-gcs-server checks no credentials")
    backend = store.backend(deadline_s=5)
    wrong = ({"access_key_id": "wrong", "secret_access_key": "wrong"} if store.scheme == "s3"
             else {"account_key": "d3Jvbmc="})
    backend = type(backend)(dataclasses.replace(backend.config, **wrong))
    async with Engine(backend=backend) as engine:
        with pytest.raises(RefusedCredentialsError) as caught:
            await engine.save(_state(), f"{store.root}/step_1")
    message = str(caught.value)
    assert backend.client.endpoint in message
    assert ("AWS_ACCESS_KEY_ID" if store.scheme == "s3" else "AZURE_STORAGE") in message


@pytest.mark.parametrize(("content", "what"), [
    (None, r"File .*/key\.json was not found"),
    ("{not json", r"is not a valid json file: Expecting property name"),
    ('{"type": "service_account", "client_email": "a@b"}', r"missing fields"),
])
async def test_an_unusable_gcs_credentials_file_is_named_with_what_is_wrong(
        store: Store, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, content: str | None,
        what: str) -> None:
    """Not "set GOOGLE_APPLICATION_CREDENTIALS" when it is set: the file and its fault."""
    if store.scheme != "gs":
        pytest.skip("Google's credentials")
    key = tmp_path / "key.json"
    if content is not None:
        key.write_text(content)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    async with Engine(backend=store.backend(anonymous=False)) as engine:
        with pytest.raises(StorageError, match=rf"the credentials file {re.escape(repr(str(key)))}"
                                               rf" that GOOGLE_APPLICATION_CREDENTIALS names is "
                                               rf"unusable \(.*{what}.*\); fix or replace it"):
            await engine.save(_state(), f"{store.root}/step_1")


async def test_a_wrong_azure_account_is_named(store: Store) -> None:
    """Azure answers `ResourceNotFound` for an account it does not hold: the error names the
    account, not "no such object"."""
    if store.scheme != "az":
        pytest.skip("an Azure account's answer")
    backend = store.backend(deadline_s=5)
    account_url = backend.client.endpoint.rsplit("/", 1)[0] + "/wrongaccount"
    backend = type(backend)(dataclasses.replace(backend.config, account_url=account_url,
                                                account_name="wrongaccount"))
    async with Engine(backend=backend) as engine:
        with pytest.raises(StorageError, match=rf"the account {re.escape(account_url)} \(or "
                                               r"its container '[^']+'\) was not found "
                                               r"\(ResourceNotFound\); fix the account in "):
            await engine.save(_state(), f"{store.root}/step_1")


async def test_mmap_on_a_store_says_what_to_do_instead(store: Store) -> None:
    async with Engine() as engine:
        await engine.save(_state(), f"{store.root}/step_1")
        with pytest.raises(StorageError, match="mmap=False"):
            await engine.load(f"{store.root}/step_1", mmap=True)


@pytest.mark.parametrize("url", ["://", "://bucket", "://bucket/a//b", "://b/../x"])
async def test_malformed_urls_are_refused_by_name(url: str, store: Store) -> None:
    async with Engine() as engine:
        with pytest.raises(ValueError, match=f"expected {store.scheme}://bucket/"):
            await engine.save(_state(), store.scheme + url)


def test_flipped_and_truncated_objects_are_caught_on_load(store: Store) -> None:
    state = {"w": torch.randn(1 << 20), "v": torch.randn(1000)}
    asynctron.save(state, f"{store.root}/flip", num_bins=1)
    asynctron.save(state, f"{store.root}/cut", num_bins=1)
    for name, change in (("flip", lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:]),
                         ("cut", lambda data: data[: len(data) // 2])):
        url = f"{store.root}/{name}/__0_0.distcp"
        store.put(url, change(store.get(url)))
        with pytest.raises(CorruptCheckpointError, match=f"{name}/__0_0.distcp"):
            asynctron.load(f"{store.root}/{name}")
