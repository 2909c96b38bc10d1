"""`StorageReader`: DCP's storage reader on asynctron's reader.

`dcp.load` asks every rank for the checkpoint's metadata (`read_metadata`), lets the planner
plan (resharding included), then has every rank read its items (`read_data`). This reader
unpickles nothing but DCP's metadata types (`MetadataUnpickler`) and, in blobs, tensors and
plain values; validates the checkpoint before any item is read (every item inside its file,
chunks inside their tensors); reads with batched preadv calls on the engine's executor; and
verifies every whole item against its digest where the checkpoint carries them (checkpoints
written by `asynctron.dcp.StorageWriter` or `Engine.save(format="dcp")`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from asynctron.dcp._plugin import CheckpointPlugin
from asynctron.dcp._read_job import OpenCheckpoint, read
from asynctron.dcp._runtime import Runtime
from asynctron.errors import CorruptCheckpointError, StorageError
from asynctron.storage import Backend
from asynctron.storage.format import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    MetadataUnpickler,
    metadata_of,
    paused_gc,
)

logger = logging.getLogger(__name__)

#: torch 2.9 to 2.11's `dcp.load` catches what `read_metadata` raises and fails on its own
#: assertion that metadata is not None, the reader's message lost; 2.12's error carries it.
_DCP_LOAD_DROPS_READ_ERRORS = torch.__version__ < (2, 12)


class StorageReader(CheckpointPlugin, dcp_storage.StorageReader):
    """A `torch.distributed.checkpoint` storage reader on asynctron's reader:
    `dcp.load(state_dict, storage_reader=asynctron.dcp.StorageReader(path))`.

    Reads DCP checkpoints: those stock `FileSystemWriter` writes, and those
    `asynctron.dcp.StorageWriter` and `Engine.save(format="dcp")` write (whose items it verifies
    against their digests); and checkpoints in asynctron's own format (`Engine.save`, a drained
    step of the tiers), whose DCP metadata it makes from their manifest. Stock planners plan, so
    DTensor targets and resharding work as with stock DCP.

    Args:
        path: the checkpoint directory (or a directory whose `latest` names one);
            `dcp.load(checkpoint_id=...)` replaces it.
        verify: check every whole item's digest (where the checkpoint has digests).
        backend: holds the checkpoint (a fault-injecting fake of `asynctron.testing` in
            tests); by default the path's own (`asynctron.storage.backend_for`).
        **engine_options: `EngineConfig` fields: `num_workers` (threads, and files read at
            once), `slab_bytes` (the largest read call).

    Raises:
        ValueError: an unknown or invalid option (naming it).
    """

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True,
                 backend: Backend | None = None, **engine_options: Any) -> None:
        super().__init__("StorageReader", path, backend, engine_options)
        self.verify = verify
        self._checkpoint: OpenCheckpoint | None = None
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._close_checkpoint()
        self._relocate(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    # Not named `**kwargs`: DCP then never asks for rank-local metadata (`__<rank>.metadata`,
    # of saves with use_collectives=False), which this reader does not read.
    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        """The checkpoint's DCP metadata, after the whole checkpoint is validated.

        Raises:
            CheckpointNotFoundError: nothing committed at the path.
            CorruptCheckpointError: a damaged or hostile `.metadata` or manifest (a foreign
                global, an item outside its file, a missing data file), naming file and field.
            ValueError: the path holds one rank's shard of a step saved to tiers.

        On torch older than 2.12, whose `dcp.load` drops this error and fails on "metadata is
        None", the error is also logged at WARNING, so the reason and the path reach the user.
        """
        runtime = self._started()
        self._close_checkpoint()
        try:
            checkpoint, metadata = runtime.call(_open(runtime, self._backend, self.path),
                                                interrupted=functools.partial(
                                                    _close_once_opened, runtime))
        except Exception as error:
            if _DCP_LOAD_DROPS_READ_ERRORS:
                logger.warning("reading DCP metadata failed (torch %s's dcp.load drops this "
                               "error and says 'metadata is None'): %s: %s", torch.__version__,
                               type(error).__name__, error)
            raise
        self._checkpoint = checkpoint
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._checkpoint is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Start reading this rank's items into the planner's targets; returns at once. The
        future is done once every item is in place (or raises what failed, naming the file
        and key)."""
        runtime = self._started()
        if self._checkpoint is None:
            self.read_metadata()
        checkpoint, self._checkpoint = self._checkpoint, None
        assert checkpoint is not None
        started = runtime.start(read(runtime, checkpoint, plan, planner, verify=self.verify))
        future: Future[None] = Future()

        def settle(done: Any) -> None:
            error = None if done.cancelled() else done.exception()
            if done.cancelled() or error is not None:
                future.set_exception(error if isinstance(error, Exception) else RuntimeError(
                    f"checkpoint {self.path}: this rank's reads were cancelled"))
            else:
                future.set_result(None)

        started.add_done_callback(settle)
        return future

    def _close_checkpoint(self) -> None:
        """End the lease of a checkpoint opened by `read_metadata` but never read."""
        checkpoint, self._checkpoint = self._checkpoint, None
        if checkpoint is not None and self._runtime is not None:
            self._runtime.call(checkpoint.reader.aclose())

    def __repr__(self) -> str:
        return f"<asynctron.dcp.StorageReader {self.path!r}>"


def _close_once_opened(runtime: Runtime, opening: concurrent.futures.Future[Any]) -> None:
    """A `read_metadata` whose wait was interrupted: end the lease of what it opens (a job
    of the runtime's, so its `close` waits for it)."""
    runtime.start(_close_opened(opening))


async def _close_opened(opening: concurrent.futures.Future[Any]) -> None:
    try:
        checkpoint, _ = await asyncio.wrap_future(opening)
    except Exception:
        return  # nothing was opened
    await checkpoint.reader.aclose()


async def _open(runtime: Runtime, backend: Backend, path: str
                ) -> tuple[OpenCheckpoint, Metadata]:
    """Find the checkpoint (leased until its reader closes), validate it whole (its
    `manifest.json`, or a stock checkpoint's `.metadata`, checked against its files), and
    unpickle DCP's metadata (only DCP's types admitted)."""
    run_blocking = runtime.run_blocking
    reader = await backend.checkpoints(run_blocking).open_reader(
        path, max_files_at_once=runtime.config.num_workers)
    try:
        manifest = await reader.open()
        if manifest.shard is not None:
            raise ValueError(f"checkpoint {reader.path}: expected a whole checkpoint, found rank "
                             f"{manifest.shard.rank}'s shard of a step saved to tiers; load the "
                             "store's checkpoint of that step")
        try:
            raw = await reader.read_file(METADATA_NAME, MAX_METADATA_BYTES)
        except StorageError as error:
            if error.errno != errno.ENOENT:
                raise
            metadata = await run_blocking(metadata_of, manifest)  # asynctron's own format
        else:
            metadata = await run_blocking(_unpickle, raw, reader.path_of(METADATA_NAME))
    except BaseException:
        await reader.aclose()
        raise
    return OpenCheckpoint.of(reader, manifest), metadata


def _unpickle(raw: bytes, metadata_path: str) -> Metadata:
    """Blocks: DCP's metadata from its pickle, admitting only DCP's types."""
    with paused_gc():
        try:
            metadata = MetadataUnpickler(raw, metadata_path).load()
        except CorruptCheckpointError:
            raise
        except Exception as error:
            raise CorruptCheckpointError(
                f"metadata {metadata_path}: expected a pickled Metadata, found "
                f"{type(error).__name__}; the checkpoint is damaged or not a "
                "torch.distributed.checkpoint checkpoint", path=metadata_path) from error
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(
            f"metadata {metadata_path}: expected a pickled Metadata, found "
            f"{type(metadata).__name__}; the checkpoint is damaged or not a "
            "torch.distributed.checkpoint checkpoint", path=metadata_path)
    return metadata
