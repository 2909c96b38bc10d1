"""What only S3 has: its payload signing and checksum options, its scheme, and the job's
request budget in its config (the suite every store runs is tests/objects)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asynctron import Engine
from asynctron.storage.backends.s3 import S3Backend, S3Config
from tests.conftest import assert_same


def _state() -> dict[str, Any]:
    torch.manual_seed(1)
    return {"model": {"w": torch.randn(3 << 20), "b": torch.arange(1000)},
            "optim": {"step": 3, "lr": 1e-3, "name": "adam"}}


@pytest.mark.parametrize("options", [{"sign_payload": True}, {"store_checksums": True}])
async def test_signed_payloads_and_store_checksums_are_options_that_work(
        s3_root: str, options: dict[str, bool]) -> None:
    backend = S3Backend(S3Config(**options))
    async with Engine(backend=backend, slab_bytes=8 << 20) as engine:
        await engine.save(_state(), f"{s3_root}/step_1")
        assert_same(_state(), await engine.load(f"{s3_root}/step_1"))


def test_s3_urls_go_to_the_s3_backend_and_never_to_a_local_path(tmp_path: Any,
                                                                 monkeypatch: Any,
                                                                 s3_env: Any) -> None:
    """With the test server's settings: the process's backend is made once, from the
    environment of the first s3:// URL, and later tests of this worker use it."""
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
