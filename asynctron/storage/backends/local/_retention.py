"""Retention: deleting a job's old checkpoints (`keep_last`) and the debris of dead saves,
never anything else.

A root directory may hold checkpoints of several jobs, checkpoints saved without `keep_last`,
and things asynctron never wrote. So an engine with `keep_last` records every checkpoint it
commits in the root's ledger, `.asynctron-ledger` (a JSON line per checkpoint: its job, its
name, the engine that committed it and that engine's save number, and the identity of its
manifest file), and prunes only what the ledger says its job committed:

- order: engines by their first commit (a restart comes after the run it resumed), one
  engine's saves by request; no clock is read, so a clock that moved back changes nothing;
- a recorded checkpoint whose manifest is no longer the recorded file (removed, replaced) is
  dropped from the ledger, never deleted;
- what `latest` names and any checkpoint being loaded (`lease_checkpoint`) are kept, and
  pruned by a later commit.

Debris: the save that made a tmp dir holds it locked (`make_tmp_dir`) until it commits or
removes it, so a tmp dir nobody holds is a dead save's: the next commit in the root removes
it. Where the filesystem has no `flock`, nothing is called debris.

Commits, `latest` moves and the ledger change only under the root's exclusive lock, so two
processes pruning one root never act on each other's half-done work; deleting happens after
the lock is released, from tmp names that nobody reads.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field

from asynctron.errors import CheckpointNotFoundError, StorageError
from asynctron.storage.backends._backend import Retention
from asynctron.storage.backends._ledger import (
    LEDGER_NAME,
    MAX_LEDGER_BYTES,
    LedgerEntry,
    beyond_keep_last,
    encode_ledger,
    parse_ledger,
)
from asynctron.storage.backends.local._publish import (
    LATEST_NAME,
    TMP_MARK,
    is_committed,
    is_tmp_dir_name,
    read_latest,
    resolve_checkpoint,
    staging_path,
    tmp_dir_for,
)
from asynctron.storage.format import MANIFEST_NAME
from asynctron.storage.node_files import _sysio
from asynctron.storage.node_files._locks import DirLock

logger = logging.getLogger(__name__)

#: Files staged only under the root's exclusive lock: any found while holding it are dead.
_STAGED_FILE_PREFIXES = (LATEST_NAME + TMP_MARK, LEDGER_NAME + TMP_MARK)
_MAX_LEASE_ATTEMPTS = 8


@dataclass(slots=True)
class Removal:
    """Directories renamed out of the way (pruned checkpoints) or found dead (debris), locked
    by us; `run()` deletes them, once the root's lock is released."""

    pruned: list[str] = field(default_factory=list)
    """The checkpoints pruned, by their committed paths."""
    doomed: list[tuple[str, DirLock]] = field(default_factory=list)
    """Each directory to delete, and our exclusive lock on it."""

    def run(self) -> list[str]:
        """Blocks: delete every doomed directory; returns the failures (they stay debris)."""
        failures = []
        for path, lock in self.doomed:
            try:
                _sysio.remove_tree(path)
            except StorageError as error:
                failures.append(f"could not delete {path}: {error}")
            finally:
                lock.release()
        self.doomed.clear()
        return failures


def make_tmp_dir(root: str, final_path: str, tmp_dir: str) -> DirLock:
    """Blocks: refuse an existing `final_path`, create `tmp_dir` beside it (replacing one of
    that name a dead save left), and return the lock that marks it live until released (under
    the root's shared lock, so no cleaner sees it unlocked).

    Raises:
        FileExistsError: `final_path` exists, or a live save holds `tmp_dir`.
        StorageError: the directory could not be created, or a dead save's not removed.
    """
    with DirLock.take(root, exclusive=False):
        if _sysio.exists(final_path):
            raise FileExistsError(
                f"checkpoint {final_path}: expected a new path, found an existing one; "
                "save to a new path (e.g. one per step) or remove it first")
        if _sysio.exists(tmp_dir):
            _remove_dead_tmp_dir(final_path, tmp_dir)
        _sysio.make_dir(tmp_dir)
        return DirLock.take(tmp_dir, exclusive=False)


def _remove_dead_tmp_dir(final_path: str, tmp_dir: str) -> None:
    """Remove `tmp_dir`, an earlier save's to `final_path`, if no live save holds it."""
    try:
        stale = DirLock.try_take(tmp_dir, exclusive=True)
    except FileNotFoundError:
        return
    if stale is None:
        raise FileExistsError(f"checkpoint {final_path}: another save to this path is in "
                              f"progress (it holds {tmp_dir}); save to a new path")
    try:  # where the filesystem has no flock, a save to the same path is taken for dead
        _sysio.remove_tree(tmp_dir)
    finally:
        stale.release()


def record_commit(root: str, tmp_dir: str, name: str, retention: Retention, seq: int) -> None:
    """Blocks; call holding the root's exclusive lock, between sealing `tmp_dir` and renaming
    it to `name` (save `seq`): add it to the ledger. Recorded before the rename, so no crash
    leaves a commit unrecorded; an entry whose rename never happened names no directory with
    its manifest, and is dropped by the next pruning."""
    identity = _manifest_identity(tmp_dir)
    if identity is None:
        raise StorageError(f"checkpoint {tmp_dir}: expected its sealed manifest, found none",
                           path=tmp_dir, errno=None)
    _write_ledger(root, [*read_ledger(root), LedgerEntry(retention.job, name, retention.engine,
                                                         seq, identity)])


def retire(root: DirLock, retention: Retention | None) -> Removal:
    """Blocks; call holding `root`, the root's exclusive lock, after a commit. With
    `retention`, moves this job's checkpoints beyond `keep_last` out of the way; then claims
    the debris of dead saves. Delete both with the returned `Removal.run()` once the lock is
    released."""
    removal = Removal()
    if retention is not None:
        _prune(root.path, retention, removal)
    if root.held:  # else a live save elsewhere may be staging, unseen
        _claim_debris(root.path, removal)
    return removal


def _prune(root: str, retention: Retention, removal: Removal) -> None:
    ledger = read_ledger(root)
    entries = [entry for entry in ledger
               if _manifest_identity(os.path.join(root, entry.name)) == entry.manifest]
    latest = read_latest(root)
    keep = os.path.basename(latest) if latest is not None else None
    doomed = []
    for entry in beyond_keep_last(entries, retention):
        path = os.path.join(root, entry.name)
        if entry.name == keep:
            continue
        lock = DirLock.try_take(path, exclusive=True)
        if lock is None:
            logger.info("checkpoint %s: kept past keep_last=%d while it is being loaded; a "
                        "later commit prunes it", path, retention.keep_last)
            continue
        graveyard = tmp_dir_for(path)
        _sysio.replace_file(path, graveyard)
        removal.doomed.append((graveyard, lock))
        removal.pruned.append(path)
        doomed.append(entry)
    remaining = [entry for entry in entries if entry not in doomed]
    if len(remaining) != len(ledger):
        _write_ledger(root, remaining)
    for path in removal.pruned:
        logger.info("checkpoint %s: pruned (job %r keeps its %d newest)", path, retention.job,
                    retention.keep_last)


def _claim_debris(root: str, removal: Removal) -> None:
    """Lock every tmp dir no live save holds (for `removal`), and remove the dead staging
    files of `latest` and the ledger."""
    for name in _sysio.list_dir(root):
        path = os.path.join(root, name)
        if name.startswith(_STAGED_FILE_PREFIXES):
            logger.info("removing %s, left by a save that died", path)
            with _sysio.translate_os_errors("removing", path):
                os.remove(path)
            continue
        if not is_tmp_dir_name(name) or not _is_real_dir(path):
            continue
        try:
            lock = DirLock.try_take(path, exclusive=True)
        except FileNotFoundError:
            continue
        if lock is None:
            continue  # a live save's
        if not lock.held:  # no flock here: nothing proves it dead
            lock.release()
            continue
        logger.info("removing %s, left by a save that died", path)
        removal.doomed.append((path, lock))


def read_ledger(root: str) -> list[LedgerEntry]:
    """Blocks: the ledger's entries, in file order (see `parse_ledger`)."""
    path = os.path.join(root, LEDGER_NAME)
    if not _sysio.is_file(path):
        return []
    return parse_ledger(_sysio.read_small_file(path, MAX_LEDGER_BYTES), path,
                        _is_checkpoint_name)


def _write_ledger(root: str, entries: Sequence[LedgerEntry]) -> None:
    """Replace the ledger atomically (a crash leaves the old one or the new one)."""
    path = os.path.join(root, LEDGER_NAME)
    staging = staging_path(path)
    _sysio.write_small_file(staging, encode_ledger(entries))
    _sysio.replace_file(staging, path)
    _sysio.fsync_dir(root)


def lease_checkpoint(path: str) -> tuple[str, DirLock]:
    """Blocks: the committed checkpoint at `path` (or the one `path/latest` names), with its
    shared lock: no pruning deletes it until the lock is released.

    Raises:
        CheckpointNotFoundError: nothing committed at `path`, or each checkpoint found was
            pruned before it could be locked.
    """
    for _ in range(_MAX_LEASE_ATTEMPTS):
        resolved = os.path.realpath(resolve_checkpoint(path))
        try:
            lock = DirLock.take(resolved, exclusive=False)
        except FileNotFoundError:
            continue  # pruned meanwhile: `latest` names a newer one
        if lock.names(resolved) and is_committed(resolved):
            return resolved, lock
        lock.release()
    raise CheckpointNotFoundError(
        f"checkpoint {path}: each checkpoint found was deleted before it could be opened "
        f"({_MAX_LEASE_ATTEMPTS} times); is another job pruning this directory?", path=path)


def committed_names(root: str) -> list[str]:
    """Blocks: the names of the committed checkpoints directly under `root` (real
    directories, never through a symlink), sorted; none if `root` does not exist."""
    if not _is_real_dir(root):
        return []
    return sorted(name for name in _sysio.list_dir(root)
                  if _is_checkpoint_name(name) and _is_real_dir(os.path.join(root, name))
                  and is_committed(os.path.join(root, name)))


def remove_committed(path: str) -> bool:
    """Blocks: delete the committed checkpoint `path`: under its root's exclusive lock it is
    renamed to a tmp name (it stops being a checkpoint at once), then deleted once the lock is
    released. Returns False, removing nothing, if nothing is committed there or a load holds
    it (its lease).

    Raises:
        StorageError: the rename or the deletion failed (a tmp dir left is debris).
    """
    root = os.path.dirname(os.path.abspath(path))
    if not _is_real_dir(path):
        return False
    removal = Removal()
    with DirLock.take(os.path.realpath(root), exclusive=True):
        if not is_committed(path):
            return False
        lock = DirLock.try_take(path, exclusive=True)
        if lock is None:
            logger.info("checkpoint %s: kept while it is being loaded", path)
            return False
        graveyard = tmp_dir_for(path)
        try:
            _sysio.replace_file(path, graveyard)
        except BaseException:
            lock.release()
            raise
        removal.doomed.append((graveyard, lock))
        _sysio.fsync_dir(root)
    failures = removal.run()
    if failures:
        raise StorageError(f"checkpoint {path}: removed, but {failures[0]}", path=path,
                           errno=None)
    return True


def _manifest_identity(checkpoint: str) -> tuple[int, int] | None:
    """(inode, mtime ns) of the manifest of `checkpoint`, if it is a real directory."""
    if not _is_real_dir(checkpoint):
        return None
    try:
        info = os.stat(os.path.join(checkpoint, MANIFEST_NAME), follow_symlinks=False)
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_checkpoint_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\x00" not in name and name not in (
        ".", "..", LATEST_NAME, LEDGER_NAME) and not is_tmp_dir_name(name)
