"""Reading a committed checkpoint: the manifest, item bytes into caller buffers, or mmaps.

`CheckpointReader.open` validates the manifest and every file's size before any item is read,
so truncation is reported up front, naming the file and the first item it cuts.

`CheckpointReader.read` reads many items at once: one task per file; in each file the wanted
items, in file order, are grouped into *read batches* of at most `slab_bytes` (neighbours
closer than `MAX_GAP_BYTES` share a batch), and each batch is ONE executor call: one `preadv`
straight into the destinations (the padding between items goes to a scratch sink), then the
digest of each piece. So a checkpoint of thousands of small items costs few calls, and a large
item streams in calls of `slab_bytes`.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Callable, Sequence

from asynctron._concurrency import RunBlocking
from asynctron.storage.backends._reader_base import CheckpointReaderBase
from asynctron.storage.backends.local._publish import is_dcp_checkpoint, resolve_checkpoint
from asynctron.storage.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    METADATA_NAME,
    ItemHasher,
    ItemRecord,
    Manifest,
    ReadBatch,
    ReadJob,
    check_files,
    check_no_overlap,
    digest,
    parse_dcp_manifest,
    parse_manifest,
    plan_reads,
)
from asynctron.storage.node_files import _sysio
from asynctron.storage.node_files._locks import DirLock
from asynctron.storage.node_files._sysio import FileIO


def read_manifest(checkpoint: str) -> Manifest:
    """Blocks: read, parse and validate `checkpoint/manifest.json` (or, for a stock DCP
    checkpoint, its `.metadata`); check that every file has its recorded size and that no two
    items of a file overlap."""
    manifest_path = os.path.join(checkpoint, MANIFEST_NAME)
    if not _sysio.is_file(manifest_path) and is_dcp_checkpoint(checkpoint):
        manifest = read_dcp_manifest(checkpoint)
        check_no_overlap(manifest, os.path.join(checkpoint, METADATA_NAME))
        return manifest
    manifest = parse_manifest(_sysio.read_small_file(manifest_path, MAX_MANIFEST_BYTES),
                              manifest_path)
    check_files(manifest, lambda name: _file_size(os.path.join(checkpoint, name)),
                lambda name: os.path.join(checkpoint, name))
    check_no_overlap(manifest, manifest_path)
    return manifest


def _file_size(path: str) -> int | None:
    return _sysio.data_file_size(path) if _sysio.exists(path) else None


def read_batch(fio: FileIO, fd: int, path: str, batch: ReadBatch, jobs: Sequence[ReadJob],
               hashers: Sequence[ItemHasher] | None, scratch: memoryview | None) -> None:
    """Blocks: one preadv for the whole batch into the jobs' destinations (or `scratch`, which
    holds `batch.nbytes`, for jobs without one), then continue each segment's digest."""
    buffers, views = batch.targets(jobs, scratch)

    def key_at(file_offset: int) -> str:
        cut = [s for s in batch.segments if batch.file_offset + s.batch_offset <= file_offset]
        return jobs[(cut or batch.segments)[-1].item_index].record.key

    _sysio.read_fully(fio, fd, buffers, batch.file_offset, path, key_at)
    if hashers is not None:
        batch.hash(views, hashers)


def read_range(fio: FileIO, fd: int, path: str, key: str, offset: int, destination: memoryview,
               hasher: ItemHasher | None) -> None:
    """Blocks: read `destination.nbytes` bytes at `offset`, and continue `hasher` over them."""
    _sysio.read_fully(fio, fd, [destination], offset, path, lambda _: key)
    if hasher is not None:
        hasher.update(destination)


class LocalCheckpointReader(CheckpointReaderBase):
    """Reads items of one committed checkpoint; call `aclose` when done.

    Concurrency: several `read` calls may run at once; together they read at most
    `max_files_at_once` files at a time.
    """

    def __init__(self, fio: FileIO, path: str, run_blocking: RunBlocking, *,
                 max_files_at_once: int, lease: DirLock | None = None) -> None:
        super().__init__(path, run_blocking)
        self._fio = fio
        self._lease = lease
        self._file_slots = asyncio.Semaphore(max_files_at_once)
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}

    async def open(self) -> Manifest:
        """Find the checkpoint (following `latest`), read and validate its manifest.

        Raises:
            CheckpointNotFoundError: nothing committed at the path.
            CorruptCheckpointError: a bad manifest, or a file of the wrong size.
        """
        self.path = await self._run_blocking(resolve_checkpoint, self.requested_path)
        self.manifest = await self._run_blocking(read_manifest, self.path)
        return self.manifest

    async def fd(self, name: str) -> int:
        """The open descriptor of data file `name` (opened on first use, closed by `aclose`)."""
        if name not in self._fds:
            await self._run_blocking(self._open_file, name)
        return self._fds[name]

    def _open_file(self, name: str) -> None:
        """Blocks: open `name` and register it in the thread itself, so a cancelled caller
        leaves no descriptor unowned (`aclose` closes it)."""
        fd = _sysio.open_read(self._fio, os.path.join(self.path, name))
        if self._fds.setdefault(name, fd) != fd:  # another task opened it meanwhile
            _sysio.close(self._fio, fd, name)

    async def read_file_jobs(self, name: str, jobs: Sequence[ReadJob],
                             hashers: Sequence[ItemHasher] | None, *, slab_bytes: int,
                             progress: Callable[[int], None] | None) -> None:
        """Each read batch is ONE executor call (a preadv, then the digests); at most
        `max_files_at_once` files are read at a time.

        Memory: jobs without a destination share one scratch buffer of `slab_bytes` per file
        being read, so at most `max_files_at_once` buffers at once.
        Cancellation: the executor call in flight finishes; destinations are partly filled.
        """
        async with self._file_slots:
            fd = await self.fd(name)
            path = os.path.join(self.path, name)
            scratch = (memoryview(bytearray(slab_bytes))
                       if any(job.destination is None for job in jobs) else None)
            batches = await self._run_blocking(plan_reads, [job.record for job in jobs],
                                               slab_bytes)  # per item: off the loop
            for batch in batches:
                await self._run_blocking(read_batch, self._fio, fd, path, batch, jobs,
                                         hashers, scratch)
                if progress is not None:
                    progress(sum(segment.nbytes for segment in batch.segments))

    async def read_range(self, record: ItemRecord, start: int, destination: memoryview,
                         hasher: ItemHasher | None) -> None:
        """Read `record`'s bytes [start, +destination.nbytes) into `destination` (one executor
        call), continuing `hasher` over them."""
        fd = await self.fd(record.file)
        await self._run_blocking(read_range, self._fio, fd, self.file_path(record), record.key,
                                 record.offset + start, destination, hasher)

    async def map(self, record: ItemRecord) -> memoryview:
        """A copy-on-write memory map of the item's bytes; no byte is read until touched."""
        if record.file not in self._maps:
            fd = await self.fd(record.file)
            self._maps[record.file] = await self._run_blocking(_map_file, fd,
                                                               self.file_path(record))
        return memoryview(self._maps[record.file])[record.offset:record.offset + record.nbytes]

    async def check_mapped(self, record: ItemRecord, view: memoryview) -> None:
        """Hash a mapped item (reading every page of it) and raise if it differs."""
        if record.checksum is None:
            return
        error = self.digest_error(record, await self._run_blocking(digest, view))
        if error is not None:
            raise error

    async def read_file(self, name: str, max_bytes: int) -> bytes:
        """The whole small file `name` of the checkpoint (DCP's `.metadata`).

        Raises:
            CorruptCheckpointError: it is larger than `max_bytes`, a link, or not a file.
            StorageError: no such file, or the read failed.
        """
        return await self._run_blocking(_sysio.read_small_file, os.path.join(self.path, name),
                                         max_bytes)

    async def aclose(self) -> None:
        """Close every file and end the lease. Maps stay valid for as long as tensors use
        them."""
        fds, self._fds = self._fds, {}
        try:
            for name, fd in fds.items():
                await self._run_blocking(_sysio.close, self._fio, fd, name)
        finally:
            if self._lease is not None:
                self._lease.release()


def _map_file(fd: int, path: str) -> mmap.mmap:
    """Blocks: map a whole file copy-on-write (writes to the map never reach the file)."""
    with _sysio.translate_os_errors("mapping", path):
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)


def read_dcp_manifest(checkpoint: str) -> Manifest:
    """Blocks: read a stock DCP checkpoint's `.metadata` as a `Manifest` (no checksums; items
    are `torch.save` blobs).

    Bounded by what the file holds: every chunk list is walked once, and all of them together
    may hold one chunk per `METADATA_BYTES_PER_CHUNK` bytes of the file (lists shared between
    keys are refused before they are walked); a tensor has at most `MAX_DIMS` dims; each
    chunk's blob holds at least the chunk's bytes (so a load never allocates more than the files
    hold); error messages show bounded parts of hostile values (`brief`). Unpickling runs with
    the garbage collector paused (`paused_gc`), after `MetadataUnpickler` has bounded what the
    unpickler itself would allocate, hash and copy.

    Raises:
        CorruptCheckpointError: a foreign global in the pickle, a malformed `Metadata`, an item
            outside its file, a missing, linked or irregular data file, naming the field (and
            file) at fault.
    """
    path = os.path.join(checkpoint, METADATA_NAME)
    return parse_dcp_manifest(
        _sysio.read_small_file(path, MAX_METADATA_BYTES), checkpoint, os.path.getmtime(path),
        lambda name: (_sysio.data_file_size(os.path.join(checkpoint, name))
                      if _sysio.exists(os.path.join(checkpoint, name)) else None))
