"""`StorageWriter`: DCP's storage writer on asynctron's pipeline, with an atomic commit.

DCP drives a save in steps (`dcp.save`): every rank sets the writer up and plans locally; the
coordinator plans globally; every rank writes (`write_data`); the coordinator, given every
rank's results, finishes. This writer maps them onto asynctron's save:
- `prepare_global_plan` (coordinator): creates the tmp dir beside the checkpoint path, named
  after the path (`_commit.tmp_dir_of`), so every rank finds it without a plan saying so (DCP's
  plan caching reuses the first save's plans); a plan says only which rank's files to write;
- `write_data` (every rank): asynctron's per-bin writers on the runtime's loop (`_write_job`);
  returns a future at once;
- `finish` (coordinator): `.metadata` and `manifest.json` sealed into the tmp dir, renamed to the
  path (`_commit`); the commit, or the tmp dir's removal where it fails, is one job on the
  runtime's loop, which an interrupt of the waiting thread (Ctrl-C) does not split: the path is
  then the whole checkpoint, or nothing.
A save that fails anywhere (any rank's write, DCP's collectives, the commit) never reaches the
rename: the path is never a half checkpoint. Its tmp dir is removed when the coordinator's
writer is reset for the next save, garbage collected, by the next commit in that directory, or
by the next save to the same path.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
import uuid
import weakref
from typing import Any

from torch.distributed.checkpoint import staging
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from asynctron.dcp import _commit as _dcp_commit
from asynctron.dcp._runtime import Runtime, plugin_config, runtime_for
from asynctron.dcp._stager import stage_state_dict
from asynctron.dcp._write_job import SaveTarget, write
from asynctron.engine._staging import mark_ready
from asynctron.storage import FileIO, _sysio
from asynctron.storage._locks import DirLock

logger = logging.getLogger(__name__)


def checkpoint_path(owner: str, path: str | os.PathLike[str]) -> str:
    """`path` as an absolute path, checked to be a path.

    Raises:
        TypeError: `path` is not a str or os.PathLike (naming the owner).
        ValueError: an empty path.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{owner} path: expected a str or os.PathLike, found "
                        f"{type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{owner} path: expected a non-empty local path, found {path!r}")
    return os.path.abspath(text)


def is_local_path(checkpoint_id: object) -> bool:
    """Whether `checkpoint_id` names a local path (what the plugins save to and load from), not
    a URL such as fsspec's."""
    return isinstance(checkpoint_id, str | os.PathLike) and "://" not in os.fspath(checkpoint_id)


class _PendingSave:
    """The coordinator's tmp dir of a save that has not committed, and the lock marking it
    live (so no other commit in the directory takes it for debris). Shared with the writer's
    finalizer, so it must not refer to the writer."""

    def __init__(self) -> None:
        self.tmp_dir: str | None = None
        self.lock: DirLock | None = None

    def take(self) -> tuple[str, DirLock] | None:
        if self.tmp_dir is None or self.lock is None:
            return None
        held, self.tmp_dir, self.lock = (self.tmp_dir, self.lock), None, None
        return held


def _abandon(tmp_dir: str, lock: DirLock) -> None:
    """Blocks: remove a save's tmp dir that never committed (if `tmp_dir` still names the
    locked one), then drop its lock."""
    try:
        if lock.names(tmp_dir):
            _sysio.remove_tree(tmp_dir)
    except Exception as error:  # debris never looks committed; the next commit retries
        logger.warning("could not remove the tmp dir of a save that did not commit: %s", error)
    finally:
        lock.release()


def _abandon_pending(runtime: Runtime | None, pending: _PendingSave) -> None:
    """The writer's finalizer: hand its uncommitted tmp dir, if any, to the runtime to remove
    (never on the thread that happens to free the writer: it may be the loop's, or one inside
    a runtime call, so this only schedules, taking no lock); at exit, once the runtime is
    closed, on this thread."""
    held = pending.take()
    if held is None:
        return
    if runtime is None or not runtime.run_soon(_abandon, *held):  # exiting: no loop left
        _abandon(*held)


async def _commit_or_abandon(runtime: Runtime, tmp_dir: str, lock: DirLock, path: str,
                             files: functools.partial[dict[str, bytes]]) -> list[str]:
    """On the loop: build the commit's files, publish `tmp_dir` at `path`; if either fails,
    remove `tmp_dir`, only once the publish has stopped (`run_blocking` waits for its thread
    even when cancelled), so a rename never moves a half-removed tmp dir. Returns the
    publish's warnings."""
    try:
        warnings = await runtime.run_blocking(_dcp_commit.publish, tmp_dir, path,
                                              await runtime.run_blocking(files))
    except BaseException:
        await runtime.run_blocking(_abandon, tmp_dir, lock)
        raise
    lock.release()
    return warnings


class StorageWriter(dcp_storage.StorageWriter, staging.AsyncStager):
    """A `torch.distributed.checkpoint` storage writer on asynctron's pipeline:
    `dcp.save(state_dict, storage_writer=asynctron.dcp.StorageWriter(path))`.

    Stock planners plan (DTensor shards, deduplication); asynctron writes: one writer per bin
    file per rank (`num_bins`), pwritev from its executor (O_DIRECT where the filesystem allows
    it), every item hashed (`checksum`), every file fsynced, then the coordinator commits
    atomically: the checkpoint appears at `path` complete, or not at all. What it writes, stock
    `FileSystemReader` reads (plus a `manifest.json` that asynctron's readers verify).

    With `dcp.async_save` and no `async_stager`, it also stages (as stock `FileSystemWriter`
    does): into asynctron's staging slabs, see `AsyncStager`.

    Args:
        path: the checkpoint directory to create (`dcp.save(checkpoint_id=...)` replaces it);
            it must not exist: a checkpoint is never overwritten.
        file_io: replaces the local filesystem's data path (fault-injecting fakes in tests).
        **engine_options: `EngineConfig` fields for the writers and staging: `num_bins`,
            `num_workers`, `memory_budget_bytes`, `slab_bytes`, `direct_io`, `checksum`,
            `pin_memory`, `worker_nice_increment`.

    Raises:
        ValueError: an unknown or invalid option (naming it).

    Concurrency: one save at a time per writer (make one writer per save in flight); writers
    with the same options share one engine and its memory budget.
    """

    _synchronize_after_execute: bool = False  # `stage` returns once the copy is made

    def __init__(self, path: str | os.PathLike[str], *, file_io: FileIO | None = None,
                 **engine_options: Any) -> None:
        super().__init__()
        self.path = checkpoint_path("StorageWriter", path)
        self._config = plugin_config("StorageWriter", engine_options)
        self._file_io = file_io
        self._runtime: Runtime | None = None
        self._pending = _PendingSave()
        self._finalizer = weakref.finalize(self, _abandon_pending, None, self._pending)
        # the last commit or removal of a tmp dir started (the waiting thread may have been
        # interrupted): the next save waits for it
        self._settling: concurrent.futures.Future[Any] | None = None
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = True
        self._requested_unix_s = time.time()

    def _started(self) -> Runtime:
        if self._runtime is None:
            self._runtime = runtime_for(self._config, self._file_io)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _abandon_pending, self._runtime,
                                               self._pending)
        return self._runtime

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint path this writer saves to."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether `checkpoint_id` is a local path (what this writer saves to)."""
        return is_local_path(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (to `checkpoint_id`, if given). The tmp dir of an earlier save
        through this writer that never committed is removed now."""
        self._remove_pending()
        if checkpoint_id:
            self.path = checkpoint_path("StorageWriter", checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Raises ValueError for `use_collectives=False`: without DCP's collectives the
        ranks could not commit one checkpoint atomically."""
        if not kwargs.get("use_collectives", True):
            raise ValueError("StorageWriter: expected dcp.save with use_collectives=True, "
                             "found use_collectives=False; asynctron commits a checkpoint "
                             "only once every rank's files are written, which needs DCP's "
                             "collectives")
        self.is_coordinator = is_coordinator
        self._requested_unix_s = time.time()
        self._started()

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: create the save's tmp dir beside the path; every rank's plan says to
        write there.

        Raises:
            FileExistsError: the path exists (a checkpoint is never overwritten).
            StorageError: the tmp dir could not be created (e.g. the parent is a file).
        """
        runtime = self._started()
        self._remove_pending()
        self._pending.lock = runtime.call(runtime.run_blocking(_dcp_commit.prepare_tmp_dir,
                                                               self.path))
        self._pending.tmp_dir = _dcp_commit.tmp_dir_of(self.path)
        return [dataclasses.replace(plan, storage_data=SaveTarget(rank))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Start writing this rank's items (the plan's) into the save's tmp dir, on
        asynctron's pipeline; returns at once. The future's result: one `WriteResult` per
        stored item, once every file of this rank is written and fsynced.

        The state dict's tensors must not change until the future is done; for CUDA tensors
        the value written is the value after the work queued on the current stream now.

        Raises (through the future): StorageError on I/O failure (naming the file), TypeError
        for a dtype asynctron cannot store (naming the key).
        """
        if not isinstance(plan.storage_data, SaveTarget):
            raise ValueError("StorageWriter.write_data: expected a plan from its "
                             f"prepare_global_plan, found storage data "
                             f"{type(plan.storage_data).__name__}; save with "
                             "asynctron.dcp.StorageWriter on every rank")
        runtime = self._started()
        started = runtime.start(write(runtime, plan, planner, _dcp_commit.tmp_dir_of(self.path),
                                      mark_ready()))
        future: Future[list[WriteResult]] = Future()

        def settle(done: Any) -> None:
            error = None if done.cancelled() else done.exception()
            if done.cancelled() or error is not None:
                future.set_exception(error if isinstance(error, Exception) else RuntimeError(
                    f"checkpoint {self.path}: this rank's writes were cancelled"))
            else:
                future.set_result(done.result())

        started.add_done_callback(settle)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: commit. Writes DCP's `.metadata` (completed as stock writers do) and
        asynctron's `manifest.json` into the tmp dir, fsyncs them and the directory, renames
        it to the path and fsyncs the parent. Every rank's data files were fsynced before DCP
        called this.

        Raises:
            FileExistsError: the path appeared meanwhile; nothing is committed.
            StorageError: a write, fsync or the rename failed; nothing is committed (the tmp
                dir is removed).

        Interrupted (KeyboardInterrupt, SystemExit) while it waits, it raises at once; the
        commit goes on on the runtime's loop: the path becomes the whole checkpoint, or, if the
        commit fails, nothing (the tmp dir is removed). The next save through this writer, and
        interpreter exit, wait for it.
        """
        runtime = self._started()
        held = self._pending.take()
        if held is None:
            raise RuntimeError(f"checkpoint {self.path}: finish without a save in progress; "
                               "DCP calls it after prepare_global_plan")
        files = functools.partial(_dcp_commit.checkpoint_files, metadata, results,
                                  storage_meta=self.storage_meta(),
                                  checksum=self._config.checksum,
                                  created_unix_s=self._requested_unix_s)
        self._settling = runtime.start(_commit_or_abandon(runtime, *held, self.path, files))
        for warning in self._settling.result():
            logger.warning("%s", warning)

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """`dcp.async_save`'s staging, as `AsyncStager.stage`: a copy in asynctron's
        staging slabs, made before this returns."""
        return stage_state_dict(self._started(), state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns once the copy is made."""

    def close(self) -> None:
        """Remove the tmp dir of a save through this writer that never committed (a failed
        save leaves it until then, or until the writer is freed)."""
        self._remove_pending()

    def _remove_pending(self) -> None:
        """Remove the uncommitted tmp dir, if any, as one job on the runtime's loop, and wait
        for it (and for an earlier commit or removal whose waiting thread was interrupted)."""
        held = self._pending.take()
        if held is not None:
            runtime = self._started()
            self._settling = runtime.start(runtime.run_blocking(_abandon, *held))
        if self._settling is not None:
            concurrent.futures.wait([self._settling])  # its error, if any, was raised then
            self._settling = None

    def __repr__(self) -> str:
        return f"<asynctron.dcp.StorageWriter {self.path!r}>"

