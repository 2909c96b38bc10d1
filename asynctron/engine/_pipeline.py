"""The stage+write pipeline of one save on one rank: every bin's batches copied into slabs and
written to the bin's file, fsynced.

Tasks (one `TaskGroup`):
- the stager: batches that need a copy, interleaved across bins, are staged wave by wave: each
  wave takes as many slabs as the budget allows at once and is ONE executor call
  (`stage_wave`); batches written in place (no snapshot; `_writes_in_place` says where) need
  no copy and are ready at once;
- one writer per bin: it holds back until staging is done or the budget runs short (so the
  caller's blocking time stays close to a plain memcpy; a state larger than the budget, whose
  blocking waits for writes anyway, is written from the first batch on), then writes every
  consecutive ready batch in ONE executor call; the call that completes the file also fsyncs
  and closes it.
So the loop wakes a few times per save, not per batch. A slab goes back to the pool when its
batch is written: at the end of the writer's call, or, when another acquire is waiting for
budget, right after that batch. Each run of batches also goes to the save's other
`BatchConsumer`s (the tiers' replica sender), from the same slabs, while it is written; the
slabs go back once all are done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from asynctron._concurrency import first_error
from asynctron.engine._resources import SaveResources
from asynctron.engine._save_plan import SaveRequest
from asynctron.engine._staging import StagedBatch, in_place, stage_wave
from asynctron.storage import FileWriter, SaveArea
from asynctron.storage.backends import SaveStorage, WriteBatch


class BatchConsumer(Protocol):
    """Takes a save's staged batches beside the writers, from the same slabs: each file's
    batches in file order (the tiers' `ShardSender` streams them to the replicas)."""

    async def consume(self, name: str, file_nbytes: int,
                      batches: Sequence[WriteBatch]) -> None:
        """Take `batches` (consecutive, continuing the file `name` of `file_nbytes`; none for
        an empty file); returns once their memory may be reused.

        Raises:
            Exception: the save fails with it.
        """
        ...


class _ReadyBatches:
    """One bin's batches that are ready to write, handed to its writer in file order."""

    def __init__(self, num_batches: int) -> None:
        self.num_batches = num_batches
        self.next_index = 0
        self._ready: dict[int, StagedBatch] = {}
        self._changed = asyncio.Event()

    def put(self, batch: StagedBatch) -> None:
        self._ready[batch.index] = batch
        self._changed.set()

    async def take(self) -> list[StagedBatch]:
        """The next run of consecutive ready batches (waits for the first of them)."""
        while self.next_index not in self._ready:
            self._changed.clear()
            await self._changed.wait()
        run = []
        while self.next_index in self._ready:
            run.append(self._ready.pop(self.next_index))
            self.next_index += 1
        return run

    def drain(self) -> list[StagedBatch]:
        """Every batch never taken (after a failure)."""
        left, self._ready = list(self._ready.values()), {}
        return left


async def stage_and_write(request: SaveRequest, storage: SaveStorage, area: SaveArea,
                          resources: SaveResources, *, snapshot: bool, direct_io: bool,
                          ready: Mapping[torch.device, torch.cuda.Event],
                          on_staged: Callable[[], None],
                          consumers: Sequence[BatchConsumer] = ()) -> None:
    """Stage and write every bin of `request` into `area`, durable; `on_staged()` once
    nothing of the caller's is needed any more (with `snapshot`, once every batch is staged;
    without, once every file is written). Every batch also goes to each of `consumers`.

    Raises the first error of any task (the others are cancelled).
    Cancellation: copies and writes in flight finish; every slab goes back to the pool and
    every file is closed (the caller discards the area).
    """
    pool, copy_streams = resources.pool, resources.copy_streams
    run_blocking = resources.run_blocking
    queues = [_ReadyBatches(len(bin.batches)) for bin in request.bins]
    writers = [storage.open_writer(area, bin.layout.file_name, bin.layout.nbytes,
                                   direct_io=direct_io, checksums=request.checksums)
               for bin in request.bins]
    gate = asyncio.Event()
    pool.pressure_listeners.add(gate)
    loop = asyncio.get_running_loop()

    def release(batch: StagedBatch) -> None:
        if batch.slab is not None:
            pool.release(batch.slab)
            batch.slab = None

    def on_written(batch: WriteBatch) -> None:  # on the writer's executor thread
        if pool.num_waiting and not consumers:  # a consumer may still hold it
            loop.call_soon_threadsafe(release, batch)

    async def stage() -> None:
        batches = [(bin, queue, index)
                   for index in range(max((len(bin.batches) for bin in request.bins), default=0))
                   for bin, queue in zip(request.bins, queues, strict=True)
                   if index < len(bin.batches)]
        write_in_place = not snapshot and await _writes_in_place(
            storage, area, resources, direct_io=direct_io, num_batches=len(batches))
        waiting = []
        for bin, queue, index in batches:
            if write_in_place and in_place(bin, index):
                queue.put(StagedBatch(bin, index, None))
            else:
                waiting.append((bin, queue, index))
        waiting.reverse()
        if len(waiting) * pool.slab_bytes > pool.budget.total_bytes:
            gate.set()  # streaming through the budget: blocking waits for writes anyway
        while waiting:
            slabs = await pool.acquire(len(waiting))
            wave = []
            for slab in slabs:
                bin, queue, index = waiting.pop()
                wave.append((queue, StagedBatch(bin, index, slab)))
            try:
                await run_blocking(stage_wave, [staged for _, staged in wave], ready,
                                   copy_streams)
            except BaseException:
                for _, staged in wave:
                    release(staged)
                raise
            for queue, staged in wave:
                queue.put(staged)
        gate.set()
        if snapshot:
            on_staged()

    async def write(writer: FileWriter, queue: _ReadyBatches, name: str, nbytes: int) -> None:
        try:
            await writer.open()
            await gate.wait()
            while not writer.done:
                run = await queue.take() if queue.next_index < queue.num_batches else []
                try:
                    if not consumers:
                        await writer.write(run, on_written)  # the last call fsyncs and closes
                    else:
                        async with asyncio.TaskGroup() as all_of_them:
                            all_of_them.create_task(writer.write(run, on_written))
                            for consumer in consumers:
                                all_of_them.create_task(consumer.consume(name, nbytes, run))
                finally:
                    for batch in run:
                        release(batch)
        finally:
            await writer.aclose()

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(stage())
            for writer, queue, bin in zip(writers, queues, request.bins, strict=True):
                group.create_task(write(writer, queue, bin.layout.file_name, bin.layout.nbytes))
    except BaseExceptionGroup as group_error:
        raise first_error(group_error)  # noqa: B904 (the group stays as __context__)
    finally:
        pool.pressure_listeners.discard(gate)
        for queue in queues:
            for batch in queue.drain():
                release(batch)
    if not snapshot:
        on_staged()


async def _writes_in_place(storage: SaveStorage, area: SaveArea, resources: SaveResources, *,
                           direct_io: bool, num_batches: int) -> bool:
    """Whether a save without a snapshot writes straight from the caller's memory. On a
    device, O_DIRECT from warm aligned slabs beats buffered writes from the caller's
    memory (2.3-2.8 against 1.7 GB/s here), but not once each slab's pages are first touched
    (0.5 s per GiB): so in place where O_DIRECT is off, where the cache lacks the warm slabs,
    or on a memory filesystem (a buffered write is all its storage does)."""
    pool = resources.pool
    slabs_needed = min(num_batches, max(1, pool.budget.total_bytes // pool.slab_bytes))
    if not direct_io or pool.num_warm < slabs_needed:
        return True
    return await storage.is_in_memory(area)
