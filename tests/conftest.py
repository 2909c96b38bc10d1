"""Test setup: every async test runs on uvloop; helpers shared across test files."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist's worksteal (`make test`), every worker starts on its share of the slow
    test files, the longest first, and ends on fast ones.

    Worksteal hands worker w the w-th contiguous part of this order and lets an idle worker
    take the tail of the busiest one's queue, so a long test left for the end of a queue is
    what keeps the suite running while the other workers idle. A file stays whole (its
    module fixtures, rank pools among them, are made once).
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    weight = {path: sum(1 for item in tests if item.get_closest_marker("slow"))
              * (_BENCH_WEIGHT if path.startswith("tests/bench/") else 1)
              for path, tests in files.items()}
    slow_files = sorted((path for path in files if weight[path]), key=weight.__getitem__,
                        reverse=True)
    loads = [0.0] * workers
    queues: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for path in slow_files:  # the heaviest to the least loaded queue
        least = loads.index(min(loads))
        loads[least] += weight[path]
        queues[least].extend(files[path])
    fast = [item for path in files if not weight[path] for item in files[path]]
    ordered: list[pytest.Item] = []
    for worker, queue in enumerate(queues):
        share = len(items) * (worker + 1) // workers - len(items) * worker // workers
        fill = max(0, share - len(queue))
        ordered += queue + fast[:fill]
        fast = fast[fill:]
    items[:] = ordered + fast


_BENCH_WEIGHT = 6
"""A benchmark's smoke run costs about what six other slow tests do (30-50 s against 5-8 s)."""


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


@contextlib.contextmanager
def interrupted_once_reached(gate: Any) -> Iterator[None]:
    """Ctrl-C for the block's main thread (a KeyboardInterrupt from a SIGUSR1 handler) once
    `gate` (an `asynctron.testing` Gate) is reached; on the way out the gate is released and
    the handler restored, only once no signal can come. If the gate is never reached (a
    guard of 120 s, not a timing), it is released and nothing is raised: the test fails."""
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread().ident == main
    interrupted = threading.Event()

    def interrupt_the_wait() -> None:
        if not gate.wait_reached(timeout_s=120):
            gate.release()
            return
        # A signal that lands while the waiting thread is between releasing the GIL and
        # blocking in the lock is only handled at the next one: send until it is.
        while not interrupted.wait(timeout=0.05):
            signal.pthread_kill(main, signal.SIGUSR1)

    def interrupt(*_: Any) -> None:
        if not interrupted.is_set():
            interrupted.set()
            raise KeyboardInterrupt

    interrupter = threading.Thread(target=interrupt_the_wait, daemon=True)
    interrupter.start()
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        yield
    finally:
        interrupted.set()
        gate.release()
        interrupter.join()
        signal.signal(signal.SIGUSR1, previous)


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


def skip_without_azurite() -> None:
    """Skip the test, with the reason, where the azure extra or Azurite (or node) is missing."""
    pytest.importorskip("azure.storage.blob.aio",
                        reason="the azure extra (azure-storage-blob[aio]) is not installed")
    from asynctron.testing.azurite import azurite_binary

    try:
        azurite_binary()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real Azure Blob server, Azurite (`azurite-blob`) on 127.0.0.1, started once per
    session (skipped, with the reason, where the azure extra, Azurite or node is missing)."""
    skip_without_azurite()
    from asynctron.testing.azurite import Azurite

    with Azurite.start(str(tmp_path_factory.mktemp("azurite"))) as server:
        yield server


def skip_without_fake_gcs() -> None:
    """Skip the test, with the reason, where fake-gcs-server's binary is missing."""
    from asynctron.testing.fake_gcs import fake_gcs_binary

    try:
        fake_gcs_binary()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def fake_gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real GCS server, fake-gcs-server on 127.0.0.1, started once per session (skipped,
    with the reason, where its binary is missing)."""
    skip_without_fake_gcs()
    from asynctron.testing.fake_gcs import FakeGcs

    with FakeGcs.start(str(tmp_path_factory.mktemp("fake_gcs"))) as server:
        yield server
