"""A store that throttles, as a busy one does: SeaweedFS's own S3 circuit breaker answers 503
to every request beyond a count in flight. A save and a load slow down to what the store
serves and finish bit-exact; a store that throttles everything fails the save within the
deadline, the previous checkpoint intact. The server is this module's own (the breaker is
global to a server)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asynctron import Engine
from asynctron.errors import StorageError
from asynctron.storage.backends.s3 import S3Backend, S3Config
from asynctron.testing.seaweedfs import SeaweedFS
from tests.conftest import assert_same, skip_without_seaweedfs


@pytest.fixture(scope="module")
def throttling_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    skip_without_seaweedfs()
    with SeaweedFS.start(str(tmp_path_factory.mktemp("throttling"))) as server:
        yield server


@pytest.fixture
def limits(throttling_server: SeaweedFS) -> Iterator[SeaweedFS]:
    """The server, every limit lifted after the test."""
    try:
        yield throttling_server
    finally:
        throttling_server.limit_in_flight()


def _backend(server: SeaweedFS, **options: Any) -> S3Backend:
    env = server.environment()
    return S3Backend(S3Config(endpoint_url=server.endpoint,
                              access_key_id=env["AWS_ACCESS_KEY_ID"],
                              secret_access_key=env["AWS_SECRET_ACCESS_KEY"], **options))


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(2 << 20, generator=generator) for i in range(6)} | {
        "step": seed}


@pytest.mark.slow
async def test_a_throttled_save_and_load_finish_bit_exact_at_the_rate_the_store_serves(
        limits: SeaweedFS) -> None:
    limits.limit_in_flight(Write=2, Read=2)
    state = _state(1)
    root = f"s3://{limits.bucket}/throttled"
    backend = _backend(limits, single_put_bytes=1 << 20)  # 48 MiB as many parts in flight
    async with Engine(backend=backend, slab_bytes=4 << 20) as engine:
        result = await engine.save(state, f"{root}/step_1")
        assert result.store.num_throttled > 0  # the store did push back
        assert result.store.num_retries >= result.store.num_throttled
        budget = next(iter(backend.client.requests._budgets.values()))
        assert budget.num_cuts > 0 and budget.least_window < budget.most
        loaded = await engine.load(f"{root}/step_1")
    assert_same(loaded, state)


@pytest.mark.slow
async def test_a_store_that_throttles_every_write_fails_the_save_within_the_deadline(
        limits: SeaweedFS) -> None:
    root = f"s3://{limits.bucket}/refused"
    backend = _backend(limits, deadline_s=2.0)
    async with Engine(backend=backend) as engine:
        await engine.save(_state(1), f"{root}/step_1")
        limits.limit_in_flight(Write=0)
        started = time.monotonic()
        with pytest.raises(StorageError, match=r"kept failing.*SlowDown|ErrTooManyRequest|503"):
            await engine.save(_state(2), f"{root}/step_2")
        assert time.monotonic() - started < 2.0 + 4  # one clock (each request its own: far more)
        limits.limit_in_flight()
        assert_same(await engine.load(root), _state(1))  # latest still names step 1
        await engine.save(_state(3), f"{root}/step_3")  # the same engine saves again
        assert_same(await engine.load(root), _state(3))
