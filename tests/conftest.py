"""Test setup: every async test runs on uvloop; helpers shared across test files."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def shm_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh directory in RAM (/dev/shm) when available, for tests that write many bytes."""
    if not os.path.isdir("/dev/shm"):
        yield str(tmp_path_factory.mktemp("shm"))
        return
    path = tempfile.mkdtemp(prefix="asynctron-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def default_safe_globals() -> Iterator[None]:
    """torch.load's weights-only allowlist as torch itself sets it, for the test's duration:
    other code in the process may have extended it for good (megatron's modules, imported by
    the Megatron suite, add `argparse.Namespace`), which would admit what a test expects
    refused."""
    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(
        [g for g in added if getattr(g, "__module__", "").startswith("torch")])
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(added)


def assert_same(expected: Any, found: Any, path: str = "") -> None:
    """Structural, bit-exact equality of two state dicts (types, dtypes, shapes, bytes)."""
    assert type(expected) is type(found) or (
        isinstance(expected, torch.Tensor) and isinstance(found, torch.Tensor)
    ), f"{path}: {type(expected)} vs {type(found)}"
    if isinstance(expected, dict):
        assert list(expected) == list(found), f"{path}: keys {list(expected)} vs {list(found)}"
        for key in expected:
            assert_same(expected[key], found[key], f"{path}.{key}")
    elif isinstance(expected, list | tuple):
        assert len(expected) == len(found), path
        for i, (a, b) in enumerate(zip(expected, found, strict=True)):
            assert_same(a, b, f"{path}.{i}")
    elif isinstance(expected, torch.Tensor):
        assert expected.dtype == found.dtype and expected.shape == found.shape, path
        a, b = (t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
                .view(torch.uint8) for t in (expected, found))
        assert torch.equal(a, b), f"{path}: bytes differ"
    elif isinstance(expected, np.ndarray):
        assert expected.dtype == found.dtype and expected.shape == found.shape, path
        assert expected.tobytes() == found.tobytes(), path
    else:
        assert expected == found or (expected != expected and found != found), path


def skip_without_seaweedfs() -> None:
    """Skip the test, with the reason, where the s3 extra or SeaweedFS's binary is missing."""
    pytest.importorskip("aiobotocore", reason="the s3 extra (aiobotocore) is not installed")
    from asynctron.testing.seaweedfs import weed_binary

    try:
        weed_binary()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3-compatible server, SeaweedFS (`weed mini`) on 127.0.0.1, started once per
    session (skipped, with the reason, where the s3 extra or its binary is missing)."""
    skip_without_seaweedfs()
    from asynctron.testing.seaweedfs import SeaweedFS

    with SeaweedFS.start(str(tmp_path_factory.mktemp("seaweedfs"))) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The AWS chain pointed at the test server (and nothing else of the user's)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    return s3_server
