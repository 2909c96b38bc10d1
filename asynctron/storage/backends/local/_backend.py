"""`LocalBackend`: checkpoints and datasets on a local (POSIX) filesystem.

A save's area is a tmp dir beside its checkpoint, `.asynctron.tmp-<hex>` (nothing of the
checkpoint's name in it: `_publish.tmp_dir_for`), held under a shared `flock` while the save
is live; `commit` is ONE executor call that seals it (manifest written and fsynced, the
directory fsynced), records it in the root's ledger, renames it into place, moves `latest`,
prunes and claims the debris of dead saves, all under the root's exclusive lock (`_publish`,
`_retention`). Data files are written with pwritev/preadv on the caller's executor, O_DIRECT
where the filesystem takes it (`_writer`, `_reader`, `_sysio`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from asynctron._concurrency import RunBlocking
from asynctron.errors import AsynctronError, StorageError
from asynctron.storage.backends._backend import Committed, Retention, SaveArea
from asynctron.storage.backends.local import _publish, _retention
from asynctron.storage.backends.local._reader import LocalCheckpointReader
from asynctron.storage.backends.local._writer import BinWriter
from asynctron.storage.format import Checksums
from asynctron.storage.node_files import _sysio
from asynctron.storage.node_files._files import LocalFiles
from asynctron.storage.node_files._locks import DirLock
from asynctron.storage.node_files._sysio import FileIO

logger = logging.getLogger(__name__)


class LocalBackend(LocalFiles):
    """The local filesystem, through `file_io` for the data path (a fault-injecting fake of
    `asynctron.testing` in tests).

    Concurrency: one backend serves any number of saves and loads at once, through any number
    of bindings (`checkpoints`); each save's area is its own.
    """

    def __init__(self, file_io: FileIO | None = None) -> None:
        super().__init__(file_io)
        self._live: dict[str, DirLock] = {}
        """The areas this backend made and holds, by location, until committed or discarded."""

    def locate(self, path: str | os.PathLike[str]) -> str:
        return os.path.abspath(os.fspath(path))

    def checkpoints(self, run_blocking: RunBlocking) -> LocalCheckpoints:
        return LocalCheckpoints(self.file_io, self._live, run_blocking)

    def __repr__(self) -> str:
        return f"<LocalBackend {type(self.file_io).__name__}, {len(self._live)} saves live>"


class LocalCheckpoints:
    """A `LocalBackend`'s checkpoints, their file calls run through `run_blocking`.

    Args:
        live: the backend's areas held live, shared by all its bindings.
    """

    def __init__(self, file_io: FileIO, live: dict[str, DirLock],
                 run_blocking: RunBlocking) -> None:
        self.file_io = file_io
        self._live = live
        self._run_blocking = run_blocking

    def area_of(self, final_path: str, name: str | None = None) -> SaveArea:
        return SaveArea(final_path, _publish.tmp_dir_for(final_path, name))

    async def start_save(self, area: SaveArea) -> None:
        self._live[area.location] = await self._run_blocking(_make_area, area)

    def open_writer(self, area: SaveArea, name: str, nbytes: int, *, direct_io: bool,
                    checksums: Checksums | None) -> BinWriter:
        return BinWriter(self.file_io, os.path.join(area.location, name), nbytes,
                         self._run_blocking, direct_io=direct_io, checksums=checksums)

    async def is_in_memory(self, area: SaveArea) -> bool:
        return await self._run_blocking(_sysio.filesystem_type, area.location) in (
            _sysio.MEMORY_FILESYSTEMS)

    async def commit(self, area: SaveArea, files: Callable[[], Mapping[str, bytes]], *,
                     retention: Retention | None, seq: int, move_latest: bool) -> Committed:
        lock = self._live.pop(area.location, None)
        try:
            committed = await self._run_blocking(_commit, area, files, retention, seq,
                                                 move_latest)
        except BaseException:
            if lock is not None:
                self._live[area.location] = lock  # still live: the caller discards it
            raise
        if lock is not None:
            lock.release()
        return committed

    async def discard(self, area: SaveArea) -> None:
        lock = self._live.pop(area.location, None)
        if lock is not None:
            await self._run_blocking(_remove_area, area.location, lock)

    async def open_reader(self, path: str, *, max_files_at_once: int) -> LocalCheckpointReader:
        checkpoint, lease = await self._run_blocking(_retention.lease_checkpoint, path)
        return LocalCheckpointReader(self.file_io, checkpoint, self._run_blocking,
                                     max_files_at_once=max_files_at_once, lease=lease)

    async def list_checkpoints(self, root: str) -> list[str]:
        return await self._run_blocking(_retention.committed_names, root)

    async def remove_checkpoint(self, path: str) -> bool:
        return await self._run_blocking(_retention.remove_committed, path)


def _make_area(area: SaveArea) -> DirLock:
    """Blocks: refuse an existing checkpoint, then create the area's directory (and the
    parents of both); returns the lock that marks it live."""
    root = os.path.dirname(area.final_path)
    with _sysio.translate_os_errors("creating directory", root):
        os.makedirs(root, exist_ok=True)
    return _retention.make_tmp_dir(os.path.realpath(root), area.final_path, area.location)


def _commit(area: SaveArea, files: Callable[[], Mapping[str, bytes]],
            retention: Retention | None, seq: int, move_latest: bool) -> Committed:
    """Blocks: under the root's exclusive lock, seal the area, record it in the ledger, rename
    it into place (the commit), move `latest`, prune and claim the debris; then delete what
    was pruned and the debris, once the lock is released."""
    final_path = area.final_path
    warnings = []
    moved = False
    removal = _retention.Removal()
    with DirLock.take(os.path.realpath(os.path.dirname(final_path)), exclusive=True) as root:
        _publish.seal_dir(area.location, files())
        if retention is not None:
            _retention.record_commit(root.path, area.location, os.path.basename(final_path),
                                     retention, seq)
        _publish.publish_dir(area.location, final_path)
        if move_latest:
            try:
                _publish.point_latest(final_path)
                moved = True
            except AsynctronError as error:
                warnings.append(f"checkpoint {final_path} is committed, but `latest` was not "
                                f"moved to it: {error}")
        try:
            removal = _retention.retire(root, retention)
        except AsynctronError as error:
            warnings.append(f"checkpoint {final_path} is committed, but pruning older ones "
                            f"and removing debris failed: {error}")
    warnings.extend(removal.run())
    return Committed(moved, tuple(removal.pruned), tuple(warnings))


def _remove_area(location: str, lock: DirLock) -> None:
    """Blocks: remove a save's area if `location` still names the locked directory, then drop
    the lock; a failure is logged (debris never looks committed; the next commit retries)."""
    try:
        if lock.names(location):
            _sysio.remove_tree(location)
    except StorageError as error:
        logger.warning("could not remove the area of a save that did not commit: %s", error)
    finally:
        lock.release()
