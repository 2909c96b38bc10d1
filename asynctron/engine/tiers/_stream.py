"""A shard's files sent to other ranks' local tiers over torch.distributed, and received there:
replicas at save time (from the staged slabs, as they are written), and a lost shard at
restore (from a holder's files).

The stream from one rank to another, on a `PeerChannel` (one tag per save):

    begin {step, rank}                      a shard of `rank`'s, at `step`, follows
    data {file, file_nbytes, offset, sizes} + payload buffers      (any order across files,
                                                                    in order within one)
    end {ok, sizes} + the shard's manifest                          (ok: commit; else discard)

The receiver writes each file as it comes into a save area of its local tier, and commits the
shard (the same atomic commit as a save: fsynced files, manifest last, rename) only once `end`
says the sender committed it too; anything else leaves no shard. Nothing is verified here:
a restore verifies every item's digest before it uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from asynctron._concurrency import first_error
from asynctron.comm import PeerChannel
from asynctron.engine.tiers._layout import join, shard_name
from asynctron.errors import CorruptCheckpointError
from asynctron.storage import FileWriter, Manifest, SaveArea
from asynctron.storage.backends import CheckpointStorage, SaveStorage, WriteBatch
from asynctron.storage.format import MANIFEST_NAME

logger = logging.getLogger(__name__)


class ShardSender:
    """Sends one shard's files (those `sends` names) to `destinations` (ranks of `channel`'s
    group): a `BatchConsumer` of a save.

    The stream begins with its first message (so waiting for `turn`, one stream to a peer at
    a time, never delays the staging before it) and `end` ends it; a sender that is ended
    without any data still sends `begin` and `end`, which its receivers wait for.

    Concurrency: `consume` may be called by several writers at once (one per file); each message
    reaches every destination whole.
    """

    def __init__(self, channel: PeerChannel, destinations: Sequence[int], *, tag: int,
                 step: int, rank: int, world_size: int,
                 turn: contextlib.AbstractAsyncContextManager[None],
                 sends: Callable[[str], bool]) -> None:
        self.destinations = list(destinations)
        self._channel = channel
        self._tag = tag
        self._step = step
        self._rank = rank
        self._world_size = world_size
        self._turn = turn
        self._sends = sends
        self._stack: contextlib.AsyncExitStack | None = None
        self._begun: asyncio.Lock = asyncio.Lock()
        self.failed: dict[int, BaseException] = {}
        """Destinations whose stream broke (a peer gone), with the error."""

    async def _to_all(self, header: dict[str, object],
                      payload: Sequence[memoryview] = ()) -> None:
        async def one(dst: int) -> None:
            try:
                await self._channel.send(dst, header, payload, tag=self._tag)
            except BaseException as error:
                self.failed.setdefault(dst, error)
                raise

        live = [dst for dst in self.destinations if dst not in self.failed]
        try:
            async with asyncio.TaskGroup() as group:
                for dst in live:
                    group.create_task(one(dst))
        except BaseExceptionGroup as error:
            raise first_error(error) from None

    async def _begin(self) -> None:
        """Wait for this stream's turn, then say which shard follows (once)."""
        async with self._begun:
            if self._stack is not None:
                return
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(self._turn)
            self._stack = stack
            await self._to_all({"kind": "begin", "step": self._step, "rank": self._rank,
                                "world_size": self._world_size})

    async def consume(self, name: str, file_nbytes: int,
                      batches: Sequence[WriteBatch]) -> None:
        """`batches` of the file `name` to every destination, from where they lie (nothing,
        for a file the stream does not carry)."""
        if not self._sends(name):
            return
        await self._begin()
        for batch in batches:
            buffers = list(batch.buffers())
            await self._to_all({"kind": "data", "file": name, "file_nbytes": file_nbytes,
                                "offset": batch.file_offset,
                                "sizes": [buffer.nbytes for buffer in buffers]}, buffers)
        if not batches and file_nbytes == 0:  # an empty file: made all the same
            await self._to_all({"kind": "data", "file": name, "file_nbytes": 0, "offset": 0,
                                "sizes": []})

    async def end(self, manifest: bytes | None) -> None:
        """Close the stream: the shard committed (`manifest`), or not (None: the receivers
        discard it); then the next stream's turn comes. A destination whose stream broke is
        skipped."""
        try:
            await self._begin()
            payload = [] if manifest is None else [memoryview(manifest)]
            await self._to_all({"kind": "end", "ok": manifest is not None,
                                "sizes": [len(manifest)] if manifest else []}, payload)
        finally:
            if self._stack is not None:
                await self._stack.aclose()


@dataclass(frozen=True, slots=True)
class Chunk:
    """A run of one file's bytes in a buffer (received, or read from a shard's file): a
    `WriteBatch` for writers that take no digests (the shard's manifest has them)."""

    file_offset: int
    nbytes: int
    view: memoryview

    def buffers(self) -> list[memoryview]:
        return [self.view]

    def bodies(self) -> NoReturn:
        raise AssertionError("a shard's chunks are written without digests")


class ReceiveBuffers:
    """The buffers a rank receives shard bytes into, its own (never the staging budget: a
    receiver waiting for memory its own save holds would stall the ring of senders).

    Memory: `count` buffers of `nbytes`, allocated on first use and kept.
    """

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._count = count
        self._free: asyncio.Queue[memoryview] | None = None

    async def take(self) -> memoryview:
        if self._free is None:
            self._free = asyncio.Queue()
            for _ in range(self._count):
                self._free.put_nowait(memoryview(torch.empty(self.nbytes,
                                                             dtype=torch.uint8).numpy()))
        return await self._free.get()

    def give(self, buffer: memoryview) -> None:
        assert self._free is not None
        self._free.put_nowait(buffer)


async def open_shard(storage: CheckpointStorage, shard: str) -> Manifest:
    """The committed `shard`'s manifest, its files' sizes checked against the disk.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: no such shard, or a damaged one (or
            a checkpoint that is not a shard).
    """
    reader = await storage.open_reader(shard, max_files_at_once=1)
    try:
        manifest = await reader.open()
    finally:
        await reader.aclose()
    if manifest.shard is None:
        raise CorruptCheckpointError(f"shard {shard}: expected a shard's manifest (one rank's "
                                     "part of a step), found a whole checkpoint's", path=shard)
    return manifest


@dataclass(frozen=True, slots=True)
class ShardReceived:
    """A shard a receiver committed: whose, which step, where."""

    step: int
    rank: int
    path: str


async def receive_shard(channel: PeerChannel, src: int, *, tag: int,
                        storage: CheckpointStorage, root: str,
                        buffers: ReceiveBuffers) -> ShardReceived | None:
    """Receive the shard rank `src` streams (`ShardSender`) into the local tier `root`, and
    commit it there; None if the sender ended without committing its own.

    Raises:
        PeerError: the sender is gone (the area is discarded).
        FileExistsError: the shard is already there.
        StorageError: writing it failed (the area is discarded; the stream is drained first,
            so the sender is never left waiting).

    Cancellation: the area is discarded; the sender's next message then fails on its side.
    """
    begin, _ = await channel.receive(src, memoryview(b""), tag=tag)
    if begin.get("kind") != "begin":
        raise ValueError(f"shard stream from rank {src}: expected 'begin', found {begin!r}")
    step, rank = int(begin["step"]), int(begin["rank"])
    path = join(root, shard_name(step, rank, int(begin["world_size"])))
    area = storage.area_of(path)
    writers: dict[str, FileWriter] = {}
    writes: dict[str, asyncio.Task[None]] = {}
    failure: BaseException | None = None
    try:
        try:
            try:
                await storage.start_save(area)
            except FileExistsError:  # an earlier life's copy of this step: replaced
                await storage.remove_checkpoint(path)
                await storage.start_save(area)
        except BaseException as error:  # drain the stream all the same
            failure = error
        while True:
            buffer = await buffers.take()
            try:
                header, got = await channel.receive(src, buffer, tag=tag)
                payload = await _whole(channel, src, tag, header, buffer, got)
            except BaseException:
                buffers.give(buffer)
                raise
            if header["kind"] == "end":
                manifest = bytes(payload)
                buffers.give(buffer)
                break
            if failure is not None:  # only drained
                buffers.give(buffer)
                continue
            _write(header, payload, buffer, buffers, writers, writes, area, storage)
            failure = _first_failure(writes)
        await asyncio.gather(*writes.values(), return_exceptions=True)
        failure = failure or _first_failure(writes)
        if failure is not None:
            raise failure
        if not header["ok"]:
            logger.info("replica of rank %d's shard of step %d: its sender did not commit it; "
                        "discarded", rank, step)
            for writer in writers.values():
                await writer.aclose()
            await storage.discard(area)
            return None
        if not all(writer.done for writer in writers.values()):
            raise ValueError(f"shard stream from rank {src}: 'end' before every file was whole")
        await storage.commit(area, lambda: {MANIFEST_NAME: manifest}, retention=None, seq=0,
                             move_latest=False)
        return ShardReceived(step, rank, area.final_path)
    except BaseException:
        for task in writes.values():
            task.cancel()
        await asyncio.gather(*writes.values(), return_exceptions=True)
        for writer in writers.values():
            await writer.aclose()
        await storage.discard(area)
        raise


async def _whole(channel: PeerChannel, src: int, tag: int, header: dict[str, Any],
                 buffer: memoryview, got: int) -> memoryview:
    """A message's payload: what landed in `buffer`, or (too large for it: a large shard's
    manifest) received now into memory of its own."""
    nbytes = sum(int(size) for size in header.get("sizes", ()))
    if got == nbytes:
        return buffer[:nbytes]
    if header["kind"] != "end":
        raise ValueError(f"shard stream from rank {src}: a message of {nbytes} bytes, over "
                         f"the {buffer.nbytes}-byte buffers (is slab_bytes the same on every "
                         "rank?)")
    whole = memoryview(bytearray(nbytes))
    await channel.receive_into(src, [whole], tag=tag)
    return whole


def _write(header: dict[str, Any], payload: memoryview, buffer: memoryview,
           buffers: ReceiveBuffers, writers: dict[str, FileWriter],
           writes: dict[str, asyncio.Task[None]], area: SaveArea,
           storage: SaveStorage) -> None:
    """Write a data message's payload (after the same file's previous write, as a task); the
    buffer goes back once written."""
    name = str(header["file"])
    writer = writers.get(name)
    if writer is None:
        writer = writers[name] = storage.open_writer(
            area, name, int(header["file_nbytes"]), direct_io=False, checksums=None)
    batch = Chunk(int(header["offset"]), payload.nbytes, payload)
    writes[name] = asyncio.ensure_future(_write_after(writes.get(name), writer, batch,
                                                      buffers, buffer))


async def _write_after(before: asyncio.Task[None] | None, writer: FileWriter,
                       batch: Chunk, buffers: ReceiveBuffers, buffer: memoryview) -> None:
    try:
        if before is None:
            await writer.open()
        else:
            await before
        await writer.write([batch] if batch.nbytes else [], lambda _: None)
    finally:
        buffers.give(buffer)


def _first_failure(writes: dict[str, asyncio.Task[None]]) -> BaseException | None:
    for task in writes.values():
        if task.done() and not task.cancelled() and task.exception() is not None:
            return task.exception()
    return None
