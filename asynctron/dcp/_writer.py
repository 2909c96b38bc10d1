"""`StorageWriter`: DCP's storage writer on asynctron's pipeline, with an atomic commit.

DCP drives a save in steps (`dcp.save`): every rank sets the writer up and plans locally; the
coordinator plans globally; every rank writes (`write_data`); the coordinator, given every
rank's results, finishes. This writer maps them onto asynctron's save:
- `prepare_global_plan` (coordinator): makes the save's area (a tmp dir beside the checkpoint
  path), named from the path alone (`_commit.area_of`), so every rank finds it without a plan
  saying so (DCP's plan caching reuses the first save's plans); a plan says only which rank's
  files to write;
- `write_data` (every rank): asynctron's per-bin writers on the runtime's loop (`_write_job`);
  returns a future at once;
- `finish` (coordinator): `.metadata` and `manifest.json` written into the area last, the area
  published at the path (storage's `commit_checkpoint`, as the engine's saves); the commit, or
  the area's removal where it fails, is one job on the runtime's loop, which an interrupt of
  the waiting thread (Ctrl-C) does not split: the path is then the whole checkpoint, or
  nothing.
A save that fails anywhere (any rank's write, DCP's collectives, the commit) never reaches the
publish: the path is never a half checkpoint. Its area is removed when the coordinator's
writer is reset for the next save, garbage collected, by the next commit in that directory, or
by the next save to the same path.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
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
from asynctron.dcp._plugin import CheckpointPlugin
from asynctron.dcp._runtime import Runtime
from asynctron.dcp._stager import stage_state_dict
from asynctron.dcp._write_job import SaveTarget, write
from asynctron.engine.lowlevel import mark_ready
from asynctron.storage import Backend, SaveArea
from asynctron.storage.backends import SaveStorage, commit_checkpoint


class _PendingSave:
    """The coordinator's area of a save that has not committed, and the checkpoints it is in.
    Shared with the writer's finalizer, so it must not refer to the writer."""

    def __init__(self) -> None:
        self.held: tuple[SaveStorage, SaveArea] | None = None

    def take(self) -> tuple[SaveStorage, SaveArea] | None:
        held, self.held = self.held, None
        return held


def _abandon_pending(runtime: Runtime | None, pending: _PendingSave) -> None:
    """The writer's finalizer: hand its uncommitted area, if any, to the runtime to remove
    (never on the thread that happens to free the writer: it may be the loop's, or one inside
    a runtime call, so this only schedules, taking no lock). At exit, once the runtime is
    closed, the area stays: its save's process is ending, and the next commit beside it
    removes what a dead save left."""
    held = pending.take()
    if held is not None and runtime is not None:
        storage, area = held
        runtime.start_soon(storage.discard, area)  # if it is still the live one


async def _start_save(storage: SaveStorage, area: SaveArea, pending: _PendingSave) -> None:
    """On the loop: make the save's area and hold it in `pending`, for the commit or the
    removal (also when the thread waiting for this was interrupted)."""
    await storage.start_save(area)
    pending.held = (storage, area)


async def _commit_or_abandon(storage: SaveStorage, area: SaveArea,
                             files: functools.partial[dict[str, bytes]]) -> None:
    """On the loop: publish `area` with `files()` written last; if that fails, discard the
    area, only once the publish has stopped (`run_blocking` waits for its thread even when
    cancelled), so a publish never moves a half-removed area."""
    try:
        await commit_checkpoint(storage, area, files)
    except BaseException:
        await storage.discard(area)
        raise


class StorageWriter(CheckpointPlugin, dcp_storage.StorageWriter, staging.AsyncStager):
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
        backend: stores the checkpoint (a fault-injecting fake of `asynctron.testing` in
            tests); by default the path's own (`asynctron.storage.backend_for`).
        **engine_options: `EngineConfig` fields for the writers and staging: `num_bins`,
            `num_workers`, `memory_budget_bytes`, `slab_bytes`, `direct_io`, `checksum`,
            `pin_memory`, `worker_nice_increment`.

    Raises:
        ValueError: an unknown or invalid option (naming it).

    Concurrency: one save at a time per writer (make one writer per save in flight); writers
    with the same options share one engine and its memory budget.
    """

    _synchronize_after_execute: bool = False  # `stage` returns once the copy is made

    def __init__(self, path: str | os.PathLike[str], *, backend: Backend | None = None,
                 **engine_options: Any) -> None:
        super().__init__("StorageWriter", path, backend, engine_options)
        self._pending = _PendingSave()
        self._finalizer = weakref.finalize(self, _abandon_pending, None, self._pending)
        # the last commit or removal of an area started (the waiting thread may have been
        # interrupted): the next save waits for it
        self._settling: concurrent.futures.Future[Any] | None = None
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = True
        self._requested_unix_s = time.time()

    def _started(self) -> Runtime:
        """The runtime (`Plugin._started`); once it is started, the finalizer that removes an
        abandoned save's area runs its removal there."""
        first = self._runtime is None
        runtime = super()._started()
        if first:
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _abandon_pending, runtime, self._pending)
        return runtime

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (to `checkpoint_id`, if given). The area of an earlier save
        through this writer that never committed is removed now."""
        self._remove_pending()
        self._relocate(checkpoint_id)
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
        """Coordinator: make the save's area (a tmp dir beside the path); every rank writes
        there.

        Raises:
            FileExistsError: the path exists (a checkpoint is never overwritten).
            StorageError: the area could not be made (e.g. the parent is a file).
        """
        runtime = self._started()
        self._remove_pending()
        storage = self._backend.checkpoints(runtime.run_blocking)
        area = _dcp_commit.area_of(storage, self.path)
        runtime.call(_start_save(storage, area, self._pending), interrupted=self._settle_later)
        return [dataclasses.replace(plan, storage_data=SaveTarget(rank))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Start writing this rank's items (the plan's) into the save's area, on
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
        storage = self._backend.checkpoints(runtime.run_blocking)
        started = runtime.start(write(runtime, plan, planner, storage,
                                      _dcp_commit.area_of(storage, self.path), mark_ready()))
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
        asynctron's `manifest.json` into the save's area last and publishes it at the path
        (on a filesystem: fsyncs, the rename, the parent's fsync). Every rank's data files
        were durable before DCP called this.

        Raises:
            FileExistsError: the path appeared meanwhile; nothing is committed.
            StorageError: a write, fsync or the publish failed; nothing is committed (the area
                is removed).

        Interrupted (KeyboardInterrupt, SystemExit) while it waits, it raises at once; the
        commit goes on on the runtime's loop: the path becomes the whole checkpoint, or, if the
        commit fails, nothing (the area is removed). The next save through this writer, and
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
        self._settling = runtime.start(_commit_or_abandon(*held, files))
        self._settling.result()

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """`dcp.async_save`'s staging, as `AsyncStager.stage`: a copy in asynctron's
        staging slabs, made before this returns."""
        return stage_state_dict(self._started(), state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns once the copy is made."""

    def close(self) -> None:
        """Remove the area of a save through this writer that never committed (a failed
        save leaves it until then, or until the writer is freed)."""
        self._remove_pending()

    def _settle_later(self, started: concurrent.futures.Future[None]) -> None:
        """An interrupted wait for the area: the next reset or close waits for it first."""
        self._settling = started

    def _remove_pending(self) -> None:
        """Remove the uncommitted area, if any, as one job on the runtime's loop, and wait
        for it (and, first, for an earlier start, commit or removal whose waiting thread was
        interrupted)."""
        if self._settling is not None:
            concurrent.futures.wait([self._settling])  # its error, if any, was raised then
            self._settling = None
        held = self._pending.take()
        if held is not None:
            storage, area = held
            self._settling = self._started().start(storage.discard(area))
        if self._settling is not None:
            concurrent.futures.wait([self._settling])  # its error, if any, was raised then
            self._settling = None

    def __repr__(self) -> str:
        return f"<asynctron.dcp.StorageWriter {self.path!r}>"

