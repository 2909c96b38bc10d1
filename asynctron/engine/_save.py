"""One save, from state dict to committed checkpoint: the pipeline behind `Engine.save`.

Stages:
1. on the caller's call, `flatten` validates the state dict (bad input raises at once) and
   CUDA tensors get a ready event on their current stream; nothing is copied yet;
2. `build_request` plans on the executor (`_save_plan`; a state dict of thousands of tensors
   never stalls the loop);
3. per bin, a stager task and a writer task joined by a queue: the stager copies and hashes
   batch after batch into slabs (bounded by the memory budget), the writer pwritev's them in
   file order, then fsyncs. Writers hold back until staging is done or the budget runs short,
   so the caller's blocking time stays close to a plain memcpy. The loop's work per batch is
   constant: each stage and each write is one executor call;
4. `Committer.commit`: manifest, fsyncs, rename, `latest` (never moved backwards), pruning.
A failure or cancellation anywhere removes the tmp dir; the previous checkpoint is untouched.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from asynctron._concurrency import RunBlocking, first_error, uncancellable
from asynctron.engine._plan_cache import PlanCache
from asynctron.engine._save_plan import SaveRequest, build_request
from asynctron.engine._staging import SlabPool, StagedBatch, Stager
from asynctron.engine._task import SaveResult
from asynctron.storage import _commit, _sysio
from asynctron.storage._manifest import Manifest
from asynctron.storage._plan import FlatStateDict
from asynctron.storage._sysio import FileIO
from asynctron.storage._writer import BinWriter


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveOptions:
    """How one save runs: the engine's settings at the time of the request."""

    num_bins: int
    rank: int
    snapshot: bool
    batch_nbytes: int
    direct_io: bool
    checksum: str | None


class Committer:
    """Publishes checkpoints: one commit per root at a time; `latest` only ever moves forward."""

    def __init__(self, run_blocking: RunBlocking, keep_last: int | None) -> None:
        self._run_blocking = run_blocking
        self._keep_last = keep_last
        self._locks: dict[str, asyncio.Lock] = {}
        self._newest: dict[str, int] = {}

    async def commit(self, tmp_dir: str, final_path: str, manifest: Manifest, seq: int) -> None:
        """Publish `tmp_dir` as `final_path`; point `latest` at it unless a newer save (higher
        `seq`) already committed; prune beyond `keep_last`.

        Raises:
            FileExistsError: `final_path` exists (the tmp dir is left for the caller).
            StorageError: a write, fsync or rename failed.
        """
        root = os.path.dirname(final_path)
        lock = self._locks.setdefault(root, asyncio.Lock())
        async with lock:
            await self._run_blocking(_commit.commit_dir, tmp_dir, final_path, manifest)
            if seq > self._newest.get(root, -1):
                self._newest[root] = seq
                await self._run_blocking(_commit.point_latest, final_path)
            if self._keep_last is not None:
                await self._run_blocking(_commit.prune_checkpoints, root, self._keep_last)


class SaveJob:
    """Runs one save to commit. Not constructed directly; `Engine.save` makes one."""

    def __init__(self, flat: FlatStateDict, path: str, *, seq: int, options: SaveOptions,
                 ready: Mapping[torch.device, torch.cuda.Event], stager: Stager, fio: FileIO,
                 run_blocking: RunBlocking, committer: Committer, plan_cache: PlanCache,
                 on_staged: Callable[[], None]) -> None:
        self.path = os.path.abspath(path)
        self.seq = seq
        self._flat = flat
        self._options = options
        self._ready = ready
        self._stager = stager
        self._pool: SlabPool = stager.pool
        self._fio = fio
        self._run_blocking = run_blocking
        self._committer = committer
        self._plan_cache = plan_cache
        self._on_staged = on_staged
        self._bins_left_to_stage = 0
        self._write_gate = asyncio.Event()
        self._t_request = time.perf_counter()
        self._requested_unix_s = time.time()
        self._t_staged: float | None = None

    def _mark_staged(self) -> None:
        self._t_staged = time.perf_counter()
        self._write_gate.set()
        self._on_staged()

    async def run(self) -> SaveResult:
        """Plan, stage, write and commit. Raises one error (ExceptionGroups unwrapped, kept as
        `__context__`); whatever happens, the tmp dir is gone afterwards."""
        options = self._options
        tmp_dir = _commit.tmp_dir_for(self.path)
        self._pool.pressure_listeners.add(self._write_gate)
        try:
            await self._run_blocking(_prepare_tmp_dir, self.path, tmp_dir)
            request = await self._run_blocking(
                _build_request, self._flat, self.path, options, self._plan_cache)
            layouts = request.plan.layouts
            writers = [BinWriter(self._fio, os.path.join(tmp_dir, layout.file_name), layout,
                                 self._run_blocking, direct_io=options.direct_io)
                       for layout in layouts]
            self._bins_left_to_stage = len(writers)
            if not writers or not options.snapshot:
                self._write_gate.set()
            if not writers and options.snapshot:
                self._mark_staged()
            try:
                async with asyncio.TaskGroup() as group:
                    for index, writer in enumerate(writers):
                        group.create_task(self._save_bin(request, index, writer))
            except BaseExceptionGroup as group_error:
                raise first_error(group_error)  # noqa: B904 (the group stays as __context__)
            if not options.snapshot:
                self._mark_staged()
            t_written = time.perf_counter()
            manifest: Manifest = await self._run_blocking(
                request.manifest, self._requested_unix_s, options.checksum)
            await self._committer.commit(tmp_dir, self.path, manifest, self.seq)
        except BaseException:
            cleanup = asyncio.ensure_future(self._run_blocking(_sysio.remove_tree, tmp_dir))
            await uncancellable(cleanup)
            raise
        finally:
            self._pool.pressure_listeners.discard(self._write_gate)
        t_done = time.perf_counter()
        return SaveResult(
            path=self.path,
            nbytes=request.nbytes,
            files=tuple(layout.file_name for layout in layouts),
            num_items=len(request.plan.records),
            stage_s=(self._t_staged or t_done) - self._t_request,
            write_s=t_written - self._t_request,
            commit_s=t_done - t_written,
            total_s=t_done - self._t_request,
        )

    async def _save_bin(self, request: SaveRequest, index: int, writer: BinWriter) -> None:
        # Unbounded by count on purpose: every entry holds a slab, so the budget bounds it.
        queue: asyncio.Queue[StagedBatch | None] = asyncio.Queue(maxsize=0)
        await writer.open()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._stage_bin(request, index, queue))
                group.create_task(self._write_bin(writer, queue))
            await writer.finish()
        finally:
            while not queue.empty():
                staged = queue.get_nowait()
                if staged is not None and staged.slab is not None:
                    self._pool.release(staged.slab)
            await writer.aclose()

    async def _stage_bin(self, request: SaveRequest, index: int,
                         queue: asyncio.Queue[StagedBatch | None]) -> None:
        for batch, needs_slab in zip(request.plan.batches[index], request.needs_slab[index],
                                     strict=True):
            queue.put_nowait(await self._stager.stage(
                batch, request.sources, request.hashers, needs_slab=needs_slab,
                snapshot=request.snapshot, ready=self._ready))
        queue.put_nowait(None)
        self._bins_left_to_stage -= 1
        if self._bins_left_to_stage == 0 and request.snapshot:
            self._mark_staged()

    async def _write_bin(self, writer: BinWriter,
                         queue: asyncio.Queue[StagedBatch | None]) -> None:
        await self._write_gate.wait()
        while (staged := await queue.get()) is not None:
            try:
                await writer.write(staged.batch, staged.buffers)
            finally:
                if staged.slab is not None:
                    self._pool.release(staged.slab)


def _build_request(flat: FlatStateDict, path: str, options: SaveOptions,
                   cache: PlanCache) -> SaveRequest:
    """Blocks: plan the save (see `_save_plan.build_request`)."""
    return build_request(flat, path, num_bins=options.num_bins, rank=options.rank,
                         snapshot=options.snapshot, batch_nbytes=options.batch_nbytes,
                         checksum=options.checksum is not None, cache=cache)


def _prepare_tmp_dir(final_path: str, tmp_dir: str) -> None:
    """Blocks: refuse an existing target, then create the tmp dir beside it."""
    if _sysio.exists(final_path):
        raise FileExistsError(
            f"checkpoint {final_path}: expected a new path, found an existing one; "
            "save to a new path (e.g. one per step) or remove it first")
    _sysio.make_dir(tmp_dir)
