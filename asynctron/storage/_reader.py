"""Reading a committed checkpoint: the manifest, item bytes into caller buffers, or mmaps.

`CheckpointReader.open` validates the manifest and every file's size before any item is
read, so truncation is reported up front, naming the file and the first item it cuts.
Item reads are split into calls of at most `call_nbytes`, each one executor hop; the
checksum is continued across calls and checked at the end.
"""

from __future__ import annotations

import mmap
import os

from asynctron._concurrency import RunBlocking
from asynctron.errors import CorruptCheckpointError
from asynctron.storage import _sysio
from asynctron.storage._commit import resolve_checkpoint
from asynctron.storage._manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ItemRecord,
    Manifest,
    parse_manifest,
)
from asynctron.storage._sysio import FileIO


def read_manifest(checkpoint: str) -> Manifest:
    """Blocks: read, parse and validate `checkpoint/manifest.json`, and check file sizes."""
    manifest_path = os.path.join(checkpoint, MANIFEST_NAME)
    manifest = parse_manifest(_sysio.read_small_file(manifest_path, MAX_MANIFEST_BYTES),
                              manifest_path)
    for name, expected in manifest.files.items():
        path = os.path.join(checkpoint, name)
        if not _sysio.exists(path):
            raise CorruptCheckpointError(
                f"file {path}: expected {expected} bytes, found no file; the checkpoint lost "
                "a file after commit", path=path)
        found = _sysio.file_size(path)
        if found != expected:
            cut = [i.key for i in manifest.items if i.file == name and i.offset + i.nbytes > found]
            raise CorruptCheckpointError(
                f"file {path}: expected {expected} bytes, found {found}; items "
                f"{cut[:3]} are cut (the file was truncated or changed after commit)",
                path=path, key=cut[0] if cut else None, offset=found)
    return manifest


class CheckpointReader:
    """Reads items of one committed checkpoint; call `aclose` when done.

    Concurrency: reads of different items may run at once.
    """

    def __init__(self, fio: FileIO, path: str, run_blocking: RunBlocking) -> None:
        self._fio = fio
        self._run_blocking = run_blocking
        self.requested_path = path
        self.path = path
        self.manifest: Manifest | None = None
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

    def file_path(self, record: ItemRecord) -> str:
        return os.path.join(self.path, record.file)

    async def _fd(self, name: str) -> int:
        if name not in self._fds:
            fd = await self._run_blocking(_sysio.open_read, self._fio,
                                          os.path.join(self.path, name))
            if name in self._fds:  # another task opened it meanwhile
                await self._run_blocking(_sysio.close, self._fio, fd, name)
            else:
                self._fds[name] = fd
        return self._fds[name]

    async def read_into(
        self, record: ItemRecord, destination: memoryview, *, verify: bool, call_nbytes: int
    ) -> None:
        """Fill `destination` (exactly `record.nbytes`) with the item's bytes.

        Raises:
            CorruptCheckpointError: the file ends early or the checksum differs (names file,
                key and offset).
        Cancellation: the executor call in flight finishes; `destination` is partly filled.
        """
        assert destination.nbytes == record.nbytes
        fd = await self._fd(record.file)
        path = self.file_path(record)
        crc = 0
        for start in range(0, record.nbytes, call_nbytes):
            part = destination[start:start + call_nbytes]
            crc = await self._run_blocking(
                _read_part, self._fio, fd, path, record.key, record.offset + start, part, crc,
                verify)
        if verify:
            check_crc(record, crc, path)

    async def map(self, record: ItemRecord) -> memoryview:
        """A copy-on-write memory map of the item's bytes; no byte is read until touched."""
        if record.file not in self._maps:
            fd = await self._fd(record.file)
            self._maps[record.file] = await self._run_blocking(_map_file, fd,
                                                               self.file_path(record))
        return memoryview(self._maps[record.file])[record.offset:record.offset + record.nbytes]

    async def aclose(self) -> None:
        """Close every file. Maps stay valid for as long as tensors use them."""
        fds, self._fds = self._fds, {}
        for name, fd in fds.items():
            await self._run_blocking(_sysio.close, self._fio, fd, name)


def check_crc(record: ItemRecord, crc: int, path: str) -> None:
    """Raise CorruptCheckpointError (naming file, key and offset) unless `crc` is the item's."""
    if crc != record.crc32c:
        raise CorruptCheckpointError(
            f"item {record.key!r} in {path} at offset {record.offset}: expected crc32c "
            f"{record.crc32c:#010x}, found {crc:#010x}; the file changed after commit",
            path=path, key=record.key, offset=record.offset)


def _read_part(fio: FileIO, fd: int, path: str, key: str, offset: int, part: memoryview,
               crc: int, verify: bool) -> int:
    """Blocks: read `part` from `offset`, and continue the checksum over it."""
    _sysio.read_fully(fio, fd, [part], offset, path, key)
    return _sysio.crc32c_update(crc, part) if verify else crc


def _map_file(fd: int, path: str) -> mmap.mmap:
    """Blocks: map a whole file copy-on-write (writes to the map never reach the file)."""
    with _sysio.translate_os_errors("mapping", path):
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
