"""Read planning: neighbouring items share one call, far ones do not, big ones stream; a
reader reads a bounded number of files at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from asynctron import Engine
from asynctron.storage.backends.local._reader import LocalCheckpointReader
from asynctron.storage.format._manifest import ItemRecord
from asynctron.storage.format._read_plan import MAX_GAP_BYTES, ReadJob, plan_reads
from asynctron.storage.node_files._sysio import LocalFileIO


def _record(key: str, offset: int, nbytes: int) -> ItemRecord:
    return ItemRecord(key=key, kind="bytes", file="__0_0.distcp", offset=offset, nbytes=nbytes,
                      checksum=None)


def test_neighbours_share_a_call_and_far_items_do_not() -> None:
    records = [_record("a", 0, 100), _record("b", 4096, 100),
               _record("c", 4096 + MAX_GAP_BYTES + 4096, 10)]
    batches = plan_reads(records, slab_bytes=1 << 20)
    assert [(b.file_offset, b.nbytes) for b in batches] == [(0, 4196), (4096 + MAX_GAP_BYTES
                                                                        + 4096, 10)]
    assert [(s.item_index, s.batch_offset, s.nbytes) for s in batches[0].segments] == [
        (0, 0, 100), (1, 4096, 100)]


def test_a_large_item_streams_in_calls_of_at_most_slab_bytes() -> None:
    batches = plan_reads([_record("a", 8192, 10_000)], slab_bytes=4096)
    assert [(b.file_offset, b.nbytes) for b in batches] == [
        (8192, 4096), (12288, 4096), (16384, 1808)]
    assert [s.item_offset for b in batches for s in b.segments] == [0, 4096, 8192]


def test_empty_items_need_no_call() -> None:
    assert plan_reads([_record("a", 0, 0), _record("b", 0, 0)], slab_bytes=4096) == []


class _ConcurrentFiles(LocalFileIO):
    """Counts how many distinct files are being read at the same instant."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reading: dict[int, int] = {}
        self.most_files_at_once = 0

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        with self._lock:
            self._reading[fd] = self._reading.get(fd, 0) + 1
            self.most_files_at_once = max(self.most_files_at_once, len(self._reading))
        try:
            time.sleep(0.005)
            return super().preadv(fd, buffers, offset)
        finally:
            with self._lock:
                self._reading[fd] -= 1
                if not self._reading[fd]:
                    del self._reading[fd]


async def test_verifying_reads_at_most_max_files_at_once(shm_path: str) -> None:
    """Each file being verified holds a scratch buffer: the bound on files bounds memory."""
    state = {f"w{i}": torch.full((100_000,), float(i)) for i in range(8)}
    async with Engine(num_workers=4, num_bins=6, slab_bytes=64 << 10) as engine:
        await engine.save(state, f"{shm_path}/ckpt")
        file_io = _ConcurrentFiles()
        reader = LocalCheckpointReader(file_io, f"{shm_path}/ckpt", engine.run_blocking,
                                  max_files_at_once=2)
        try:
            manifest = await reader.open()
            assert len(manifest.files) == 6
            errors = await reader.read([ReadJob(record, None) for record in manifest.items],
                                       verify=True, slab_bytes=64 << 10)
        finally:
            await reader.aclose()
    assert errors == []
    assert file_io.most_files_at_once == 2
