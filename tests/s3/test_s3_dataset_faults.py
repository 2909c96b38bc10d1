"""Faults under datasets on a real S3 server (issue 29): the store gone mid-epoch (a clear
error naming the object, the range and the endpoint, within the deadline; what is cached
still served), resets retried, a cache directory that fills (eviction or the store, never an
error), bad credentials and missing objects named, a reader killed mid-read (the next one
reads right from the same cache)."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from asynctron.datasets import IndexedDataset, ObjectStorageConfig
from asynctron.datasets.formats._builder import write_indexed_dataset
from asynctron.datasets.object_cache._object_storage import cache_path
from asynctron.datasets.object_cache._range_cache import _ENTRIES_AT
from asynctron.errors import RefusedCredentialsError, StorageError
from asynctron.storage.backends import Backend, register_backend
from asynctron.storage.backends.s3 import S3Backend, S3Config
from asynctron.testing.seaweedfs import SeaweedFS
from asynctron.testing.tcp_proxy import TcpFaultProxy
from tests.datasets.conftest import random_documents
from tests.s3.conftest import upload_dataset

MiB = 1 << 20
BLOCK = 4096  # the cache's block for objects below 16 GiB


@pytest.fixture
def proxy(s3_env: SeaweedFS) -> Iterator[TcpFaultProxy]:
    host, _, port = s3_env.endpoint.removeprefix("http://").partition(":")
    with TcpFaultProxy.start(host, int(port)) as proxy:
        yield proxy


@pytest.fixture
def serve_s3() -> Iterator[Callable[[Backend], None]]:
    """`serve_s3(backend)`: s3:// URLs use `backend` until the test ends, then the default."""
    replaced: list[Callable[[], Backend] | None] = []
    yield lambda backend: replaced.append(register_backend("s3", lambda: backend))
    if replaced and replaced[0] is not None:
        register_backend("s3", replaced[0])


def _through(proxy: TcpFaultProxy, server: SeaweedFS, *, deadline_s: float) -> S3Backend:
    env = server.environment()
    return S3Backend(S3Config(endpoint_url=proxy.endpoint, access_key_id=env["AWS_ACCESS_KEY_ID"],
                              secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                              deadline_s=deadline_s, read_timeout_s=2, connect_timeout_s=1))


@pytest.fixture
def small_disk(tmp_path: Any) -> Iterator[str]:
    """A 4 MiB tmpfs (skipped where the test cannot mount one), unmounted afterwards."""
    directory = str(tmp_path / "small-disk")
    os.makedirs(directory)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", directory],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs to fill ({mounted.stderr.strip()}); needs root")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", directory], check=False)


def _used_bytes(directory: str) -> int:
    stat = os.statvfs(directory)
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def _blocks_of(local: IndexedDataset, i: int) -> tuple[int, int]:
    """The byte range `[start, end)` of the cache blocks that sample `i` touches."""
    start, nbytes = local.byte_range(i)
    end = (start + nbytes - 1) // BLOCK * BLOCK + BLOCK
    return start // BLOCK * BLOCK, min(end, os.path.getsize(local.bin_path))


# -- the store gone ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("faults", [["stall"], ["reset"], ["reset", "refuse"]],
                         ids=["stalled", "resetting", "down"])
def test_a_store_gone_mid_epoch_fails_a_miss_clearly_and_serves_what_is_cached(
        faults: list[str], corpus: tuple[IndexedDataset, str], tmp_path: Any, s3_env: SeaweedFS,
        proxy: TcpFaultProxy, serve_s3: Callable[[Backend], None]) -> None:
    local, url = corpus
    serve_s3(_through(proxy, s3_env, deadline_s=3))
    ds = IndexedDataset(url, mmap=False,
                        object_storage_config=ObjectStorageConfig(str(tmp_path / "cache")))
    for i in range(50):
        assert np.array_equal(ds[i], local[i])
    for fault in faults:  # "down": its connections reset, then its port closed
        getattr(proxy, fault)()
    last = len(ds) - 1
    start, end = _blocks_of(local, last)
    started = time.monotonic()
    with pytest.raises(StorageError) as caught:
        ds[last]
    assert time.monotonic() - started < 20
    message = str(caught.value)
    assert f"{url}.bin bytes [{start}, {end})" in message, message
    assert proxy.endpoint in message, message
    assert re.search(r"(answered none of this read's requests|connection refused) for [23]\.\d "
                     r"s", message), message
    for i in range(50):  # the store is still gone: the cache serves what it holds
        assert np.array_equal(ds[i], local[i])
    proxy.pass_through()
    assert np.array_equal(ds[last], local[last])
    for i in np.random.default_rng(0).permutation(len(ds))[:100].tolist():
        assert np.array_equal(ds[i], local[i])


def test_connection_resets_mid_read_are_retried_inside_the_deadline(
        corpus: tuple[IndexedDataset, str], tmp_path: Any, s3_env: SeaweedFS,
        proxy: TcpFaultProxy, serve_s3: Callable[[Backend], None]) -> None:
    local, url = corpus
    serve_s3(_through(proxy, s3_env, deadline_s=30))
    ds = IndexedDataset(url, mmap=False,
                        object_storage_config=ObjectStorageConfig(str(tmp_path / "cache")))
    opened = proxy.connections_opened
    rng = np.random.default_rng(1)
    order = rng.permutation(len(ds)).tolist()
    for at in range(0, 600, 60):
        batch = order[at:at + 60]
        starts = ds.sequence_pointers[batch].astype(np.int64) // np.dtype(ds.dtype).itemsize
        ds.fetch_ahead(starts, ds.sequence_lengths[batch].astype(np.int64))
        if at % 120:
            proxy.reset()  # every connection, downloads in flight included
            proxy.pass_through()
        else:
            proxy.drop_after(int(rng.integers(0, 4000)), then="pass_through")
        for i in batch:
            assert np.array_equal(ds[i], local[i])
    assert proxy.connections_opened > opened + 5  # the resets cost connections, not reads


# -- a cache directory that fills ----------------------------------------------------------------

@pytest.mark.slow
def test_a_cache_disk_that_fills_evicts_and_never_fails_a_read(
        small_disk: str, tmp_path: Any, s3_root: str, s3_objects: Any) -> None:
    local = write_indexed_dataset(str(tmp_path / "local" / "big"),
                                  random_documents(6, 500, max_length=12000, eod=0),
                                  dtype=np.int32)  # ~12 MB on a 4 MiB disk
    url = f"{s3_root}/big"
    upload_dataset(s3_objects, local.path_prefix, url)
    config = ObjectStorageConfig(small_disk, cache_budget_bytes=64 * MiB)  # beyond the disk
    ds = IndexedDataset(url, mmap=False, object_storage_config=config)
    size = os.statvfs(small_disk).f_blocks * os.statvfs(small_disk).f_frsize
    most = 0
    for i in np.random.default_rng(2).permutation(len(ds)).tolist():
        assert np.array_equal(ds[i], local[i])
        most = max(most, _used_bytes(small_disk))
    assert size - MiB // 4 < most <= size  # the disk did fill
    for i in range(0, len(ds), 97):  # and what stayed cached is right
        assert np.array_equal(ds[i], local[i])


#: the child scripts' `fill(disk)`: another tenant fills the disk to the last byte
_FILL = textwrap.dedent("""
    import os

    def fill(disk):
        with open(os.path.join(disk, "filler"), "wb") as f:
            try:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()
            except OSError:
                pass
        print("filled", flush=True)
""")

_FILL_AND_READ = _FILL + textwrap.dedent("""
    import os, sys
    import numpy as np
    from asynctron.datasets import IndexedDataset, ObjectStorageConfig

    url, local_prefix, disk = sys.argv[1], sys.argv[2], sys.argv[3]
    local = IndexedDataset(local_prefix)
    ds = IndexedDataset(url, mmap=False, object_storage_config=ObjectStorageConfig(disk))
    fill(disk)
    for i in range(len(ds) - 1, len(ds) - 20, -1):  # blocks beyond the table's first page
        assert np.array_equal(ds[i], local[i])
    print("read", flush=True)
""")


@pytest.mark.slow
def test_a_cache_disk_filled_by_another_file_serves_from_the_store(
        small_disk: str, tmp_path: Any, s3_root: str, s3_objects: Any) -> None:
    """The disk filled by someone else after the open, nothing of ours to evict: reads are
    served from the store, and the process lives."""
    local = write_indexed_dataset(str(tmp_path / "local" / "m"),
                                  random_documents(7, 2000, max_length=2400, eod=0),
                                  dtype=np.int32)  # ~9.6 MB: a block table over 2 pages
    url = f"{s3_root}/m"
    upload_dataset(s3_objects, local.path_prefix, url)
    child = subprocess.run([sys.executable, "-c", _FILL_AND_READ, url, local.path_prefix,
                            small_disk], capture_output=True, text=True, timeout=60,
                           env=os.environ | {"PYTHONPATH": os.getcwd()})
    assert child.returncode == 0 and child.stdout.split() == ["filled", "read"], (
        child.returncode, child.stdout, child.stderr[-2000:])


_FULL_THEN_OPEN = _FILL + textwrap.dedent("""
    import os, sys
    from asynctron.datasets import IndexedDataset, ObjectStorageConfig

    url, disk = sys.argv[1], sys.argv[2]
    fill(disk)
    try:
        IndexedDataset(url, mmap=False, object_storage_config=ObjectStorageConfig(disk))
    except OSError as error:
        print(type(error).__name__, error.errno, error, flush=True)
""")


@pytest.mark.slow
def test_a_full_cache_disk_fails_the_open_with_an_os_error_naming_it(
        small_disk: str, corpus: tuple[IndexedDataset, str]) -> None:
    _, url = corpus
    child = subprocess.run([sys.executable, "-c", _FULL_THEN_OPEN, url, small_disk],
                           capture_output=True, text=True, timeout=60,
                           env=os.environ | {"PYTHONPATH": os.getcwd()})
    assert child.returncode == 0, (child.returncode, child.stdout, child.stderr[-2000:])
    lines = child.stdout.splitlines()
    assert lines[0] == "filled" and f" {errno.ENOSPC} " in lines[1], lines
    assert small_disk in lines[1], lines


def test_a_read_only_cache_directory_fails_the_open_naming_it(
        small_disk: str, corpus: tuple[IndexedDataset, str]) -> None:
    _, url = corpus
    remounted = subprocess.run(["mount", "-o", "remount,ro", small_disk], capture_output=True,
                               text=True)
    if remounted.returncode:
        pytest.skip(f"cannot remount the tmpfs read-only ({remounted.stderr.strip()})")
    with pytest.raises(OSError, match=small_disk) as caught:
        IndexedDataset(url, mmap=False, object_storage_config=ObjectStorageConfig(small_disk))
    assert caught.value.errno == errno.EROFS


# -- credentials and missing objects -------------------------------------------------------------

def test_wrong_credentials_name_the_endpoint_and_the_object_and_what_to_set(
        corpus: tuple[IndexedDataset, str], tmp_path: Any, s3_env: SeaweedFS,
        serve_s3: Callable[[Backend], None]) -> None:
    _, url = corpus
    serve_s3(S3Backend(S3Config(endpoint_url=s3_env.endpoint,
                                access_key_id=s3_env.environment()["AWS_ACCESS_KEY_ID"],
                                secret_access_key="not-the-secret", deadline_s=5)))
    config = ObjectStorageConfig(str(tmp_path / "cache"))
    with pytest.raises(RefusedCredentialsError) as caught:
        IndexedDataset(url, mmap=False, object_storage_config=config)
    message = str(caught.value)
    for expected in (s3_env.endpoint, f"{url}.idx", "refused our credentials",
                     "AWS_SECRET_ACCESS_KEY"):
        assert expected in message, message


def test_credentials_from_the_environment_that_are_wrong_say_so(
        corpus: tuple[IndexedDataset, str], tmp_path: Any, s3_env: SeaweedFS,
        monkeypatch: pytest.MonkeyPatch, serve_s3: Callable[[Backend], None]) -> None:
    _, url = corpus
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    serve_s3(S3Backend())  # a backend made now, from the environment
    with pytest.raises(StorageError, match=r"refused our credentials.*AWS_ACCESS_KEY_ID") as e:
        IndexedDataset(url, mmap=False,
                       object_storage_config=ObjectStorageConfig(str(tmp_path / "cache")))
    assert s3_env.endpoint in str(e.value) and f"{url}.idx" in str(e.value)


def test_missing_buckets_and_objects_name_endpoint_bucket_and_key(
        corpus: tuple[IndexedDataset, str], tmp_path: Any, s3_env: SeaweedFS,
        s3_objects: Any) -> None:
    _, url = corpus
    config = ObjectStorageConfig(str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError) as caught:
        IndexedDataset("s3://no-such-bucket/data/c", mmap=False, object_storage_config=config)
    message = str(caught.value)
    assert "s3://no-such-bucket/data/c.idx" in message and s3_env.endpoint in message, message
    bucket, _, key = url[5:].partition("/")
    s3_objects.delete_object(Bucket=bucket, Key=f"{key}.bin")  # the .idx alone
    with pytest.raises(FileNotFoundError) as caught:
        IndexedDataset(url, mmap=False, object_storage_config=config)
    message = str(caught.value)
    assert f"{url}.bin" in message and s3_env.endpoint in message, message


# -- a reader killed -----------------------------------------------------------------------------

_READER = textwrap.dedent("""
    import sys
    import numpy as np
    from asynctron.datasets import IndexedDataset, ObjectStorageConfig

    url, cache, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ds = IndexedDataset(url, mmap=False, object_storage_config=ObjectStorageConfig(cache))
    rng = np.random.default_rng(seed)
    total = int(ds.sequence_pointers[-1]) // 2 + int(ds.sequence_lengths[-1])  # tokens
    while True:
        for n, i in enumerate(rng.permutation(len(ds)).tolist()):
            start = ds.sequence_pointers[i] // 2
            ds.fetch_ahead(np.array([start]), np.array([min(ds.sequence_lengths[i] * 4,
                                                            total - start)]))
            ds[i]
            if n % 25 == 0:
                print(n, flush=True)
""")


@pytest.mark.slow
def test_a_reader_killed_mid_read_leaves_a_cache_the_next_reads_right(
        corpus: tuple[IndexedDataset, str], tmp_path: Any) -> None:
    local, url = corpus
    cache = str(tmp_path / "shared")
    readers = [subprocess.Popen([sys.executable, "-c", _READER, url, cache, str(seed)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=os.environ | {"PYTHONPATH": os.getcwd()})
               for seed in range(2)]
    rng = random.Random(0)
    for reader in readers:  # both reading, then killed one after the other, at random
        assert reader.stdout is not None
        reader.stdout.readline()
    for reader in readers:
        time.sleep(rng.uniform(0.0, 0.4))
        reader.send_signal(signal.SIGKILL)
        _, errors = reader.communicate()
        assert reader.returncode == -signal.SIGKILL, errors[-2000:]
    data = cache_path(url + ".bin", cache)
    for lock in (data + ".lock", cache_path(url + ".idx", cache) + ".lock"):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: no stale lock
        finally:
            os.close(fd)
    with open(data + ".blocks", "rb") as f:
        f.seek(_ENTRIES_AT)
        cached = np.flatnonzero(np.frombuffer(f.read(2 * -(-os.path.getsize(data) // BLOCK)),
                                              np.uint16) & 1)
    assert cached.size > 0  # the killed readers left blocks behind
    with open(data, "rb") as got, open(local.bin_path, "rb") as expected:
        for block in cached.tolist():  # each block marked cached holds the object's bytes
            got.seek(block * BLOCK)
            expected.seek(block * BLOCK)
            assert got.read(BLOCK) == expected.read(BLOCK), block
    ds = IndexedDataset(url, mmap=False, object_storage_config=ObjectStorageConfig(cache))
    for i in np.random.default_rng(9).permutation(len(ds)).tolist():
        assert np.array_equal(ds[i], local[i])
