"""One save, from state dict to committed checkpoint, on this rank: the pipeline behind
`Engine.save`.

Stages:
1. on the caller's call, `flatten` validates the state dict (bad input raises at once) and
   CUDA tensors get a ready event on their current stream; nothing is copied yet;
2. `Coordinator.start`: the coordinator creates the tmp dir; all ranks agree whether the plan
   of this global structure is cached;
3. planning on the executor (`_save_plan`; a state dict of thousands of tensors never stalls
   the loop), with the plan exchange across ranks unless the plan was cached;
4. per bin, a stager task and a writer task joined by a queue: the stager copies batch after
   batch into slabs (bounded by the memory budget), the writer hashes and pwritev's them in
   file order, then fsyncs. Writers hold back until staging is done or the budget runs short,
   so the caller's blocking time stays close to a plain memcpy. The loop's work per batch is
   constant: each stage and each write is one executor call;
5. `Coordinator.finish`: the coordinator commits the manifest of every rank's items (fsyncs,
   rename, `latest` never moved backwards, pruning) only if every rank succeeded.
A failure or cancellation anywhere, on any rank, removes the tmp dir and commits nothing; the
previous checkpoint is untouched.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata

from asynctron._concurrency import RunBlocking, first_error, uncancellable
from asynctron.engine._coordinator import Coordinator, Start, WriteReport, describe
from asynctron.engine._plan_cache import FilePlan, PlanCache
from asynctron.engine._save_plan import SaveRequest, build_request, file_plan, structure_digest
from asynctron.engine._staging import SlabPool, StagedBatch, Stager
from asynctron.engine._task import SaveResult
from asynctron.storage._dcp import METADATA_NAME as DCP_METADATA_NAME
from asynctron.storage._dcp import metadata_bytes
from asynctron.storage._manifest import MANIFEST_NAME, Manifest
from asynctron.storage._plan import (
    FlatStateDict,
    item_paths,
    merge_structures,
    plan_final,
    plan_local,
)
from asynctron.storage._sysio import FileIO
from asynctron.storage._writer import BinWriter


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveOptions:
    """How one save runs: the engine's settings at the time of the request."""

    num_bins: int
    snapshot: bool
    batch_nbytes: int
    direct_io: bool
    checksum: str | None
    format: Literal["asynctron", "dcp"]


class SaveJob:
    """Runs one save to commit. Not constructed directly; `Engine.save` makes one."""

    def __init__(self, flat: FlatStateDict, path: str, *, seq: int, options: SaveOptions,
                 ready: Mapping[torch.device, torch.cuda.Event], stager: Stager, fio: FileIO,
                 run_blocking: RunBlocking, coordinator: Coordinator, plan_cache: PlanCache,
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
        self._coordinator = coordinator
        self._plan_cache = plan_cache
        self._on_staged = on_staged
        self._bins_left_to_stage = 0
        self._write_gate = asyncio.Event()
        self._writing: asyncio.Future[None] | None = None
        self._aborted = False
        self._t_request = time.perf_counter()
        self._requested_unix_s = time.time()
        self._t_staged: float | None = None

    def _mark_staged(self) -> None:
        self._t_staged = time.perf_counter()
        self._write_gate.set()
        self._on_staged()

    async def run(self) -> SaveResult:
        """Start, plan, stage, write and finish across ranks. Raises one error (ExceptionGroups
        unwrapped, kept as `__context__`): this rank's own, or `PeerError` naming the rank that
        failed; whatever happens, nothing is committed unless every rank succeeded.

        Cancellation: this rank's writing stops, but the save still takes part in the
        protocol's collectives, reporting itself failed (the other ranks wait for them), then
        the cancellation is raised; the tmp dir is removed and nothing commits. A cancellation
        that arrives once every rank has written may find the checkpoint committed.
        """
        protocol = asyncio.ensure_future(self._protocol())
        try:
            return await asyncio.shield(protocol)
        except asyncio.CancelledError:
            self._aborted = True
            if self._writing is not None:
                self._writing.cancel()
            await uncancellable(protocol)
            if not protocol.cancelled():
                protocol.exception()  # the cancellation wins; mark the outcome as seen
            raise

    async def _protocol(self) -> SaveResult:
        coordinator, seq = self._coordinator, self.seq
        local_error: BaseException | None = None
        request: SaveRequest | None = None
        metadata: Metadata | None = None
        try:
            async with coordinator.planning_turn(seq):
                digest = await self._digest()
                held = self._plan_cache.snapshot()  # the plans announced are the plans used
                start = await coordinator.start(self.path, digest, list(held))
                try:
                    request, metadata = await self._plan(start, held)
                except (Exception, asyncio.CancelledError) as error:  # reported at finish
                    local_error = error
        except BaseException:
            await coordinator.skip_finishing(seq)  # the start failed on every rank
            raise
        if local_error is None and self._aborted:  # cancelled while planning
            local_error = asyncio.CancelledError()
        t_planned = time.perf_counter()
        if local_error is None:
            assert request is not None
            self._writing = asyncio.ensure_future(self._write(request, start.tmp_dir))
            try:
                await self._writing
            except BaseException as error:  # reported to the others, then raised below
                local_error = error
        t_written = time.perf_counter()
        report: WriteReport | None = None
        if request is not None and local_error is None:  # a record per item: off the loop
            try:
                report = await self._run_blocking(request.report, coordinator.rank)
            except BaseException as error:  # reported to the others, then raised below
                local_error = error
        if report is None:
            report = WriteReport(rank=coordinator.rank, error=describe(local_error))
        warnings: tuple[str, ...] = ()
        async with coordinator.finishing_turn(seq):
            try:
                warnings = await coordinator.finish(
                    report, path=self.path, tmp_dir=start.tmp_dir, seq=seq,
                    publish=self._publish, metadata=metadata)
            except BaseException:
                if local_error is None:
                    raise
        if local_error is not None:
            raise local_error
        assert request is not None
        t_done = time.perf_counter()
        return SaveResult(
            path=self.path,
            nbytes=request.nbytes,
            files=tuple(layout.file_name for layout in request.plan.layouts),
            num_items=len(request.plan.records),
            plan_s=t_planned - self._t_request,
            stage_s=(self._t_staged or t_done) - self._t_request,
            write_s=t_written - self._t_request,
            commit_s=t_done - t_written,
            total_s=t_done - self._t_request,
            warnings=warnings,
        )

    async def _digest(self) -> str | None:
        options = self._options
        if options.format == "dcp":  # pickled values change size: planned afresh each time
            return None
        return await self._run_blocking(functools.partial(
            structure_digest, self._flat, num_bins=options.num_bins,
            rank=self._coordinator.rank, batch_nbytes=options.batch_nbytes))

    async def _plan(self, start: Start, held: Mapping[Hashable, FilePlan]
                    ) -> tuple[SaveRequest, Metadata | None]:
        """This rank's request: from the cached file plan when every rank holds it, else from
        DCP's planner through the plan exchange."""
        options, rank = self._options, self._coordinator.rank
        cached = held[start.plan_key] if start.cached else None
        self._plan_cache.record_use(start.plan_key, hit=cached is not None)
        if cached is not None:
            if self._aborted:
                raise asyncio.CancelledError
            request = await self._run_blocking(
                _request, self._flat, self.path, cached, None, options)
            return request, None
        local: BaseException | tuple
        try:
            if self._aborted:
                raise asyncio.CancelledError
            local = await self._run_blocking(functools.partial(
                plan_local, self._flat, is_coordinator=self._coordinator.is_coordinator))
        except (Exception, asyncio.CancelledError) as error:
            local = error
        planner, local_plan = (None, local) if isinstance(local, BaseException) else local
        share, metadata = await self._coordinator.exchange_plans(planner, local_plan)
        assert planner is not None
        save_plan = await self._run_blocking(plan_final, self._flat, planner, share, metadata)
        plan = await self._run_blocking(functools.partial(
            file_plan, save_plan, num_bins=options.num_bins, rank=rank,
            batch_nbytes=options.batch_nbytes, torch_save_frames=options.format == "dcp"))
        if start.plan_key is not None:
            self._plan_cache.store(start.plan_key, plan)
        request = await self._run_blocking(_request, self._flat, self.path, plan, save_plan,
                                           options)
        return request, metadata

    async def _write(self, request: SaveRequest, tmp_dir: str) -> None:
        """Stage and write every bin of this rank into `tmp_dir`, fsynced."""
        if self._aborted:
            raise asyncio.CancelledError
        self._pool.pressure_listeners.add(self._write_gate)
        try:
            await self._write_bins(request, tmp_dir)
        finally:
            self._pool.pressure_listeners.discard(self._write_gate)

    async def _write_bins(self, request: SaveRequest, tmp_dir: str) -> None:
        options = self._options
        writers = [BinWriter(self._fio, os.path.join(tmp_dir, layout.file_name), layout,
                             self._run_blocking, direct_io=options.direct_io,
                             hashers=request.hashers)
                   for layout in request.plan.layouts]
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

    async def _save_bin(self, request: SaveRequest, index: int, writer: BinWriter) -> None:
        # Unbounded by count on purpose: every entry holds a slab, so the budget bounds it.
        queue: asyncio.Queue[StagedBatch | None] = asyncio.Queue(maxsize=0)
        try:
            await writer.open()
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
                batch, request.sources, needs_slab=needs_slab, snapshot=request.snapshot,
                ready=self._ready))
        queue.put_nowait(None)
        self._bins_left_to_stage -= 1
        if self._bins_left_to_stage == 0 and request.snapshot:
            self._mark_staged()

    async def _write_bin(self, writer: BinWriter,
                         queue: asyncio.Queue[StagedBatch | None]) -> None:
        await self._write_gate.wait()
        while (staged := await queue.get()) is not None:
            try:
                await writer.write(staged.batch, staged.buffers, staged.bodies)
            finally:
                if staged.slab is not None:
                    self._pool.release(staged.slab)

    def _publish(self, reports: Sequence[WriteReport], metadata: Metadata | None
                 ) -> dict[str, bytes]:
        """Blocks (on the coordinator): the manifest of every rank's items; in DCP's format
        also DCP's `.metadata`, so stock `torch.distributed.checkpoint.load` reads it."""
        files: dict[str, int] = {}
        for report in reports:
            files.update(report.files)
        structure = merge_structures([r.structure for r in reports if r.structure is not None])
        records = tuple(item for r in reports for item in r.records)
        manifest = Manifest(structure=structure, items=records, files=files,
                            created_unix_s=self._requested_unix_s,
                            checksum=self._options.checksum)
        published = {MANIFEST_NAME: manifest.to_json()}
        if self._options.format == "dcp":
            published[DCP_METADATA_NAME] = metadata_bytes(
                records, [frame for r in reports for frame in r.frames], item_paths(structure),
                self.path)
        return published


def _request(flat: FlatStateDict, path: str, plan: FilePlan, save_plan: object,
             options: SaveOptions) -> SaveRequest:
    return build_request(flat, path, plan, save_plan,  # type: ignore[arg-type]
                         snapshot=options.snapshot, checksum=options.checksum is not None)

