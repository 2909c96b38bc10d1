"""One save, from state dict to committed checkpoint: the pipeline behind `Engine.save`.

Stages:
1. `prepare_save` (on the caller's call, so bad input raises at once): flatten, plan with
   DCP's planner, split items onto bins, lay out each bin file (or reuse the file plan of
   an unchanged structure from the `PlanCache`);
2. `SaveJob.run`, per bin, a stager task and a writer task joined by a queue: the stager copies
   batch after batch into slabs (bounded by the memory budget), the writer checksums and
   pwritev's them in file order, then fsyncs. Writers hold back until staging is done or the
   budget runs short, so the caller's blocking time stays close to a plain memcpy;
3. `Committer.commit`: manifest, fsyncs, rename, `latest` (never moved backwards), pruning.
A failure or cancellation anywhere removes the tmp dir; the previous checkpoint is untouched.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from asynctron._concurrency import RunBlocking, first_error, uncancellable
from asynctron.engine._plan_cache import FilePlan, PlanCache, structure_signature
from asynctron.engine._staging import ItemSource, SlabPool, StagedBatch, Stager
from asynctron.engine._task import SaveResult
from asynctron.storage import _commit, _sysio
from asynctron.storage._dtypes import dtype_name
from asynctron.storage._layout import BinLayout, bin_file_name, layout_bin
from asynctron.storage._manifest import ItemRecord, Manifest
from asynctron.storage._plan import SavePlan, Structure, flatten, item_nbytes, plan_save
from asynctron.storage._split import split_by_size_and_type
from asynctron.storage._sysio import FileIO
from asynctron.storage._writer import BinWriter


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """A planned save: everything decided before any byte moves."""

    path: str
    structure: Structure
    """The state dict's nesting and JSON values, as the manifest stores them."""
    plan: FilePlan
    sources: tuple[ItemSource, ...]
    """Per item index, where its bytes come from."""
    ready: dict[torch.device, torch.cuda.Event]
    snapshot: bool

    @property
    def layouts(self) -> tuple[BinLayout, ...]:
        return self.plan.layouts

    @property
    def records(self) -> tuple[ItemRecord, ...]:
        return self.plan.records

    @property
    def nbytes(self) -> int:
        return sum(record.nbytes for record in self.plan.records)


def prepare_save(state_dict: Mapping[str, Any], path: str, *, num_bins: int, rank: int,
                 snapshot: bool, cache: PlanCache) -> SaveRequest:
    """Plan a save of `state_dict` to `path`. Runs on the caller's thread; cheap (no copies).
    A structure seen recently reuses its file plan from `cache`.

    Raises:
        TypeError, ValueError: unsupported leaves, keys or dtypes (naming the key).
    """
    flat = flatten(state_dict)
    signature = structure_signature(flat, num_bins, rank)
    plan = cache.lookup(signature) if signature is not None else None
    if plan is None:
        save_plan = plan_save(flat)
        plan = _file_plan(save_plan, num_bins, rank)
        sources = tuple(ItemSource(save_plan.payload(item)) for item in save_plan.items)
        if signature is not None:
            cache.store(signature, plan)
    else:
        sources = tuple(ItemSource(_plain_payload(flat.leaves[key].value)) for key in plan.keys)
    return SaveRequest(path=os.path.abspath(path), structure=flat.structure, plan=plan,
                       sources=sources, ready=Stager.mark_ready(sources), snapshot=snapshot)


def _plain_payload(value: torch.Tensor | bytes) -> torch.Tensor | bytes:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _file_plan(plan: SavePlan, num_bins: int, rank: int) -> FilePlan:
    """Split the planned items onto bins (seed 000) and lay out each bin file."""
    items = plan.items
    nbytes = [item_nbytes(item, plan.flat.leaves[item.index.fqn]) for item in items]
    index_of = {id(item): i for i, item in enumerate(items)}
    bins = split_by_size_and_type(num_bins, items, lambda item: nbytes[index_of[id(item)]])
    layouts = tuple(
        layout_bin(bin_file_name(rank, b), [index_of[id(item)] for item in bin_items], nbytes)
        for b, bin_items in enumerate(bins) if bin_items
    )
    placed = {p.item_index: (layout.file_name, p.offset)
              for layout in layouts for p in layout.placements}
    records = tuple(_record(plan, item, placed[i], nbytes[i]) for i, item in enumerate(items))
    return FilePlan(keys=tuple(item.index.fqn for item in items), layouts=layouts,
                    records=records)


def _record(plan: SavePlan, item: WriteItem, place: tuple[str, int], nbytes: int) -> ItemRecord:
    key = item.index.fqn
    file, offset = place
    if item.type == WriteItemType.BYTE_IO:
        return ItemRecord(key, "bytes", None, None, None, None, file, offset, nbytes, 0)
    leaf = plan.flat.leaves[key]
    data = item.tensor_data
    assert data is not None
    dtype = leaf.numpy_dtype if leaf.kind == "ndarray" else dtype_name(
        data.properties.dtype, key)
    return ItemRecord(key, leaf.kind, dtype, tuple(data.chunk.sizes), tuple(data.size),
                      tuple(data.chunk.offsets), file, offset, nbytes, 0)


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
    """Runs one `SaveRequest` to commit. Not constructed directly; `Engine.save` makes one."""

    def __init__(self, request: SaveRequest, *, seq: int, stager: Stager, fio: FileIO,
                 run_blocking: RunBlocking, committer: Committer, batch_nbytes: int,
                 direct_io: bool, on_staged: Callable[[], None]) -> None:
        self.request = request
        self.seq = seq
        self._stager = stager
        self._pool: SlabPool = stager.pool
        self._fio = fio
        self._run_blocking = run_blocking
        self._committer = committer
        self._batch_nbytes = batch_nbytes
        self._direct_io = direct_io
        self._on_staged = on_staged
        self._bins_left_to_stage = len(request.layouts)
        self._write_gate = asyncio.Event()
        self._t_request = time.perf_counter()
        self._requested_unix_s = time.time()
        self._t_staged: float | None = None

    def _mark_staged(self) -> None:
        self._t_staged = time.perf_counter()
        self._write_gate.set()
        self._on_staged()

    async def run(self) -> SaveResult:
        """Stage, write and commit. Raises one error (ExceptionGroups unwrapped, kept as
        `__context__`); whatever happens, the tmp dir is gone afterwards."""
        request = self.request
        tmp_dir = _commit.tmp_dir_for(request.path)
        self._pool.pressure_listeners.add(self._write_gate)
        try:
            await self._run_blocking(_prepare_tmp_dir, request.path, tmp_dir)
            writers = [BinWriter(self._fio, os.path.join(tmp_dir, layout.file_name), layout,
                                 self._run_blocking, direct_io=self._direct_io)
                       for layout in request.layouts]
            if not writers or not request.snapshot:
                self._write_gate.set()
            if not writers and request.snapshot:
                self._mark_staged()
            try:
                async with asyncio.TaskGroup() as group:
                    for writer in writers:
                        group.create_task(self._save_bin(writer))
            except BaseExceptionGroup as group_error:
                raise first_error(group_error)  # noqa: B904 (the group stays as __context__)
            if not request.snapshot:
                self._mark_staged()
            t_written = time.perf_counter()
            crcs = {i: crc for writer in writers for i, crc in writer.crcs.items()}
            manifest = Manifest(
                structure=request.structure,
                items=tuple(_with_crc(r, crcs.get(i, 0)) for i, r in enumerate(request.records)),
                files={layout.file_name: layout.nbytes for layout in request.layouts},
                created_unix_s=self._requested_unix_s,
            )
            await self._committer.commit(tmp_dir, request.path, manifest, self.seq)
        except BaseException:
            cleanup = asyncio.ensure_future(self._run_blocking(_sysio.remove_tree, tmp_dir))
            await uncancellable(cleanup)
            raise
        finally:
            self._pool.pressure_listeners.discard(self._write_gate)
        t_done = time.perf_counter()
        return SaveResult(
            path=request.path,
            nbytes=request.nbytes,
            files=tuple(layout.file_name for layout in request.layouts),
            num_items=len(request.records),
            stage_s=(self._t_staged or t_done) - self._t_request,
            write_s=t_written - self._t_request,
            commit_s=t_done - t_written,
            total_s=t_done - self._t_request,
        )

    async def _save_bin(self, writer: BinWriter) -> None:
        # Unbounded by count on purpose: every entry holds a slab, so the budget bounds it.
        queue: asyncio.Queue[StagedBatch | None] = asyncio.Queue(maxsize=0)
        await writer.open()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._stage_bin(writer.layout, queue))
                group.create_task(self._write_bin(writer, queue))
            await writer.finish()
        finally:
            while not queue.empty():
                staged = queue.get_nowait()
                if staged is not None and staged.slab is not None:
                    self._pool.release(staged.slab)
            await writer.aclose()

    async def _stage_bin(self, layout: BinLayout,
                         queue: asyncio.Queue[StagedBatch | None]) -> None:
        request = self.request
        for batch in layout.batches(self._batch_nbytes):
            queue.put_nowait(await self._stager.stage(
                batch, request.sources, snapshot=request.snapshot, ready=request.ready))
        queue.put_nowait(None)
        self._bins_left_to_stage -= 1
        if self._bins_left_to_stage == 0 and request.snapshot:
            self._mark_staged()

    async def _write_bin(self, writer: BinWriter,
                         queue: asyncio.Queue[StagedBatch | None]) -> None:
        await self._write_gate.wait()
        while (staged := await queue.get()) is not None:
            try:
                await writer.write(staged.batch, staged.buffers, staged.segment_views)
            finally:
                if staged.slab is not None:
                    self._pool.release(staged.slab)


def _with_crc(record: ItemRecord, crc: int) -> ItemRecord:
    return ItemRecord(record.key, record.kind, record.dtype, record.shape, record.global_shape,
                      record.chunk_offsets, record.file, record.offset, record.nbytes, crc)


def _prepare_tmp_dir(final_path: str, tmp_dir: str) -> None:
    """Blocks: refuse an existing target, then create the tmp dir beside it."""
    if _sysio.exists(final_path):
        raise FileExistsError(
            f"checkpoint {final_path}: expected a new path, found an existing one; "
            "save to a new path (e.g. one per step) or remove it first")
    _sysio.make_dir(tmp_dir)
