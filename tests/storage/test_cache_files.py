"""The files a node-local cache shares among processes (`local/_cache_files.py`): locks that
exclude other processes (a forked child's its own), counters no concurrent update loses,
sparse block files, and publishing that leaves nothing behind when it fails."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
from typing import Any

import numpy as np
import pytest

from asynctron.storage.node_files import (
    BlockFile,
    SharedCounters,
    SharedLock,
    file_size,
    holding,
    map_shared,
    publish_filled,
    read_head,
    replace_empty,
)

_FORK = multiprocessing.get_context("fork")


def _try_lock(lock: SharedLock, reopen: bool, answer: Any) -> None:
    if reopen:
        lock.reopen()
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        answer.put("taken")
    except BlockingIOError:
        answer.put("held by another")


@pytest.mark.parametrize("reopen", [True, False], ids=["reopened", "inherited"])
def test_a_lock_excludes_other_processes_and_a_child_reopens_its_own(
        tmp_path: Any, reopen: bool) -> None:
    """A child that reopens the lock is another holder (excluded while the parent holds it);
    one that does not shares the parent's (flock belongs to the open file description)."""
    lock = SharedLock(str(tmp_path / "made" / "here.lock"))
    answer = _FORK.Queue()
    with lock:
        child = _FORK.Process(target=_try_lock, args=(lock, reopen, answer))
        child.start()
        child.join(30)
    assert answer.get(timeout=5) == ("held by another" if reopen else "taken")
    lock.close()
    lock.close()  # idempotent


def _add(path: str, times: int) -> None:
    counters = SharedCounters(path, b"TESTCNT1", 2)
    for _ in range(times):
        counters.update(lambda words: words.__setitem__(0, words[0] + 1))
    counters.close()


def test_counters_lose_no_update_of_concurrent_processes(tmp_path: Any) -> None:
    path = str(tmp_path / "counters")
    assert SharedCounters.read(path, b"TESTCNT1", 2).tolist() == [0, 0]  # none yet
    children = [_FORK.Process(target=_add, args=(path, 300)) for _ in range(3)]
    for child in children:
        child.start()
    _add(path, 300)
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    assert SharedCounters.read(path, b"TESTCNT1", 2).tolist() == [1200, 0]
    assert (read_head(path, 8) or b"") == b"TESTCNT1"


def test_a_block_file_writes_maps_and_punches_blocks_in_place(tmp_path: Any) -> None:
    path = str(tmp_path / "blocks")
    nbytes = 64 << 12
    replace_empty(path, nbytes, reserve=False)
    assert file_size(path) == nbytes and os.stat(path).st_blocks == 0  # sparse
    data = BlockFile(path, nbytes)
    mapped = np.frombuffer(data.map(), np.uint8)
    block = np.arange(8 << 12, dtype=np.uint8)
    data.write(memoryview(block), 16 << 12)
    assert np.array_equal(mapped[16 << 12:24 << 12], block)
    data.punch(16 << 12, 4 << 12)
    assert not mapped[16 << 12:20 << 12].any() and np.array_equal(mapped[20 << 12:24 << 12],
                                                                  block[4 << 12:])
    assert os.stat(path).st_blocks * 512 <= (4 << 12) + 4096  # the hole gave its room back
    data.close()
    assert data.closed
    with pytest.raises(OSError) as caught:
        BlockFile(str(tmp_path / "missing"), 1)
    assert caught.value.filename == str(tmp_path / "missing")


def test_a_table_replaced_under_a_reader_leaves_the_reader_its_old_map(tmp_path: Any) -> None:
    path = str(tmp_path / "table")
    replace_empty(path, 4096, b"old", reserve=True)
    old = map_shared(path, 4096)
    old[8:11] = b"set"
    replace_empty(path, 8192, b"new", reserve=True)
    assert old[:3] == b"old" and old[8:11] == b"set"
    new = map_shared(path, 8192)
    assert new[:3] == b"new" and new[8:11] == bytes(3) and file_size(path) == 8192
    assert sorted(os.listdir(tmp_path)) == ["table"]  # no temporary left


def test_publish_filled_publishes_whole_or_leaves_the_old_file(tmp_path: Any) -> None:
    path = str(tmp_path / "deep" / "index.idx")
    publish_filled(path, 10, lambda view: view.__setitem__(slice(None), b"0123456789"))
    assert read_head(path, 100) == b"0123456789"

    def fail(view: memoryview) -> None:
        view[:5] = b"XXXXX"
        raise ConnectionError("the store went away")

    with pytest.raises(ConnectionError):
        publish_filled(path, 20, fail)
    assert read_head(path, 100) == b"0123456789"
    assert os.listdir(tmp_path / "deep") == ["index.idx"]  # the temporary is gone
    publish_filled(path, 0, lambda view: None)
    assert read_head(path, 100) == b""


def test_holding_makes_the_directories_and_releases(tmp_path: Any) -> None:
    path = str(tmp_path / "a" / "b" / "c.lock")
    with holding(path):
        other = SharedLock(path)
        with pytest.raises(BlockingIOError):
            fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with other:  # released by `holding`
        pass
    other.close()
