"""Reads shared across ranks: in a collective load each stored item is read once per job, by
one of the ranks that need it, and sent to the others over torch.distributed.

A load of replicated state (data parallel: every rank wants every tensor; HSDP's replica
groups) would otherwise read the checkpoint once per rank from the store. Per load, every rank
at once:
1. `agree`: each rank says which of the checkpoint's items (its manifest's records) it needs.
   An item one rank needs is read by that rank alone, as without sharing (only the parts of
   it the rank holds, when resharding); so is an item under 1 KiB (a step count) by each
   rank that needs it. The items several ranks need are read whole by one
   of them: in file order, cut into a contiguous run per rank (its reads coalesce into few
   requests), sized so that every rank reads about as many bytes, its own items counted:
   the store's bytes are spread over the ranks, not all read by rank 0.
2. `read`: every rank reads its items (the reader checks each digest), the shared ones first
   (other ranks wait on those, on its own nobody), and sends each shared one, once read, to
   the other ranks that need it, a message per peer per batch (a few batches read at once, so
   sends overlap reads); the
   receivers take the bytes straight into their destinations and check the digest of what
   they received. A rank that cannot read an item tells the ranks waiting for it, so every
   rank ends the exchange and the load fails everywhere, naming the rank and its error.

Bytes travel through host memory on the channel's gloo group (CUDA targets are filled from
the received host copy).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asynctron._concurrency import RunBlocking, first_error
from asynctron.comm import PeerChannel
from asynctron.engine._collectives import Collectives
from asynctron.engine._coordinator import describe
from asynctron.errors import CorruptCheckpointError, PeerError, StorageError
from asynctron.storage import ItemRecord
from asynctron.storage.backends import ItemReader
from asynctron.storage.format import ReadJob, digest

MiB = 1 << 20
_BATCH_BYTES = 64 * MiB
"""A reader reads its shared items in batches of about this size, sending each batch while
it reads the next ones."""
_BATCHES_IN_FLIGHT = 3
"""Batches a reader reads at once (each of them ranged reads in flight, the store's request
budget bounding all), so the store's pipe does not drain between batches."""
_MAX_RECORDS_PER_MESSAGE = 256
"""Record indices per message header (a header is a 4 KiB JSON frame)."""
_MIN_SHARED_BYTES = 1024
"""An item smaller than this (an optimizer's step count, a scalar) is read by every rank that
needs it: its bytes are nothing, and sharing it would make those ranks wait on another's read
(an FSDP2 state, whose only replicated items are AdamW's step counts, then shares nothing)."""
_MAX_WHY_CHARS = 1500
_NOTHING = memoryview(b"")


@dataclass(frozen=True, slots=True)
class SharePlan:
    """Who reads each item several ranks need (by the item's index in the manifest), and
    which other ranks receive it. An item absent from `readers` is read by the one rank that
    needs it."""

    readers: dict[int, int]
    receivers: dict[int, tuple[int, ...]]

    @property
    def shared(self) -> frozenset[int]:
        return frozenset(self.readers)


@dataclass(frozen=True, slots=True)
class _Failed:
    """A rank's failure before the exchange, as told to the others."""

    rank: int
    what: str


class ReadShare:
    """One collective load's shared reads: the agreement on `group`, the bytes on `channel`
    (a gloo group of its own), messages on `tag`. Every rank of the group calls `agree`, then
    `read`, once per load (a load may agree to share nothing and skip `read`).

    Not constructed directly: `SharedLoads.share` (a collective load) or the tiers' restore
    makes one.
    """

    def __init__(self, group: Collectives, channel: PeerChannel, *, tag: int,
                 run_blocking: RunBlocking) -> None:
        self._group = group
        self._channel = channel
        self._tag = tag
        self._run_blocking = run_blocking
        self._agreed = False
        self.read_bytes = 0
        """The bytes this rank read from the checkpoint's storage."""

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    async def agree(self, needs: np.ndarray | BaseException, records: Sequence[ItemRecord]
                    ) -> SharePlan:
        """Tell every rank which of the manifest's `records` this rank needs (`needs`: a bool
        each), or that it failed before knowing (`needs` the error); learn who reads what.

        Raises:
            the error given, on its rank; `PeerError` naming the failed rank on the others.
        """
        gathered = await self._gather(needs)
        if isinstance(needs, BaseException):
            raise needs
        failed = [found for found in gathered if isinstance(found, _Failed)]
        if failed:
            raise PeerError(f"load: expected every rank to plan its reads, found rank "
                            f"{failed[0].rank} failing: {failed[0].what}", rank=failed[0].rank)
        return await self._run_blocking(_plan, gathered, records)

    async def abandon(self, error: BaseException) -> None:
        """This rank failed before `agree` (opening the checkpoint): tell the others, whose
        `agree` then raises. Nothing once this rank agreed."""
        if not self._agreed:
            await self._gather(error)

    async def _gather(self, needs: np.ndarray | BaseException) -> list[bytes | _Failed]:
        self._agreed = True
        return await self._group.all_gather_object(
            _Failed(self.rank, describe(needs)) if isinstance(needs, BaseException)
            else np.packbits(needs).tobytes())

    async def read(self, plan: SharePlan, records: Sequence[ItemRecord],
                   index: dict[int, int], jobs: Sequence[ReadJob], reader: ItemReader, *,
                   verify: bool, slab_bytes: int) -> list[CorruptCheckpointError]:
        """Fill `jobs` (this rank's reads; `index` maps `id(record)` to its place in the
        manifest's `records`): read its own and the shared items `plan` gives it, send those
        to the ranks that need them, receive the rest.

        Returns:
            as `ItemReader.read`: one error per item whose digest differs (checked where the
            item was read, and where it was received).

        Raises:
            StorageError: this rank's read failed, or (naming the rank) the read of a rank
                that reads items for this one.
            PeerError: a rank is gone.
        """
        me = self.rank
        own: list[ReadJob] = []
        to_send: list[ReadJob] = []
        landing: dict[int, memoryview] = {}
        for job in jobs:
            at = index.get(id(job.record))
            reader_rank = None if at is None else plan.readers.get(at)
            assert job.destination is not None
            if reader_rank is None:
                own.append(job)
            elif reader_rank == me:
                to_send.append(job)
            else:
                landing[at] = job.destination  # type: ignore[index]
        self.read_bytes += sum(job.record.nbytes for job in (*own, *to_send))
        expected: dict[int, set[int]] = {}
        for at in landing:
            expected.setdefault(plan.readers[at], set()).add(at)
        errors: list[CorruptCheckpointError] = []

        shared_read = asyncio.Event()

        async def read_own() -> None:  # after the items others wait for: nobody waits on these
            await shared_read.wait()
            errors.extend(await reader.read(own, verify=verify, slab_bytes=slab_bytes))

        tasks = [self._read_and_send(plan, index, to_send, reader, verify=verify,
                                     slab_bytes=slab_bytes, errors=errors, read=shared_read)]
        if own:
            tasks.append(read_own())
        tasks.extend(self._receive(src, records, landing, wanted, reader, verify=verify,
                                   errors=errors) for src, wanted in expected.items())
        await _all(tasks)
        return errors

    async def _read_and_send(self, plan: SharePlan, index: dict[int, int],
                             jobs: list[ReadJob], reader: ItemReader, *, verify: bool,
                             slab_bytes: int, errors: list[CorruptCheckpointError],
                             read: asyncio.Event) -> None:
        """Read `jobs` (this rank's shared items) in batches, `_BATCHES_IN_FLIGHT` at once,
        sending each batch once read (`read` is set once every batch's read ended); after a
        failed read, tell every receiver of each batch not sent, then raise it."""
        slots = asyncio.Semaphore(_BATCHES_IN_FLIGHT)
        failed: list[BaseException] = []
        batches = _batches(jobs)
        unread = len(batches)

        async def one(batch: list[ReadJob]) -> None:
            nonlocal unread
            async with slots:
                try:
                    if not failed:
                        found = await reader.read(batch, verify=verify, slab_bytes=slab_bytes)
                except BaseException as error:  # the receivers must hear of it
                    failed.append(error)
                finally:
                    unread -= 1
                    if not unread:
                        read.set()
            if failed:
                await self._send_failure(plan, index, batch, failed[0])
            else:
                errors.extend(found)
                await self._send(plan, index, batch, found)

        try:
            await _all(one(batch) for batch in batches)
        finally:
            read.set()
        if failed:
            raise failed[0]

    async def _send(self, plan: SharePlan, index: dict[int, int], batch: list[ReadJob],
                    bad: list[CorruptCheckpointError]) -> None:
        """Send each item of `batch` to the ranks that need it (those whose digest failed
        here as failures naming why)."""
        why = {error.key: str(error) for error in bad}

        async def to_peer(peer: int, items: list[tuple[int, ReadJob]]) -> None:
            good = [(at, job) for at, job in items if job.record.key not in why]
            for start in range(0, len(good), _MAX_RECORDS_PER_MESSAGE):
                part = good[start:start + _MAX_RECORDS_PER_MESSAGE]
                views = [job.destination for _, job in part]
                await self._channel.send(peer, {"kind": "items", "records": [at for at, _ in part],
                                                "sizes": [view.nbytes for view in views]},
                                         views, tag=self._tag)  # type: ignore[arg-type]
            for at, job in items:
                if job.record.key in why:
                    await self._channel.send(peer, {"kind": "failed", "records": [at],
                                                    "corrupt": True,
                                                    "why": why[job.record.key][:_MAX_WHY_CHARS]},
                                             tag=self._tag)

        await _all(to_peer(peer, items)
                   for peer, items in _by_receiver(plan, index, batch).items())

    async def _send_failure(self, plan: SharePlan, index: dict[int, int],
                            unsent: list[ReadJob], error: BaseException) -> None:
        """Tell each rank waiting for one of `unsent` that this rank could not read it."""
        why = describe(error)[:_MAX_WHY_CHARS]

        async def to_peer(peer: int, ats: list[int]) -> None:
            for start in range(0, len(ats), _MAX_RECORDS_PER_MESSAGE):
                await self._channel.send(peer, {
                    "kind": "failed", "records": ats[start:start + _MAX_RECORDS_PER_MESSAGE],
                    "corrupt": False, "why": why}, tag=self._tag)

        await _all(to_peer(peer, [at for at, _ in items])
                   for peer, items in _by_receiver(plan, index, unsent).items())

    async def _receive(self, src: int, records: Sequence[ItemRecord],
                       landing: dict[int, memoryview], wanted: set[int], reader: ItemReader,
                       *, verify: bool, errors: list[CorruptCheckpointError]) -> None:
        """Take every item rank `src` reads for this rank into its destination, checking
        each digest as the next message arrives.

        Raises:
            StorageError: `src` could not read an item (after every message from it was
                taken, so it is not left waiting on this rank).
        """
        pending = set(wanted)
        checking: list[asyncio.Future[list[CorruptCheckpointError]]] = []
        failed: str | None = None
        while pending:
            header, _ = await self._channel.receive(src, _NOTHING, tag=self._tag)
            ats = [int(at) for at in header["records"]]
            pending.difference_update(ats)
            if header["kind"] == "failed":
                if header["corrupt"]:
                    record = records[ats[0]]
                    errors.append(CorruptCheckpointError(
                        f"{header['why']} (read by rank {src})",
                        path=reader.file_path(record), key=record.key, offset=record.offset))
                elif failed is None:
                    failed = header["why"]
                continue
            views = [landing[at] for at in ats]
            await self._channel.receive_into(src, views, tag=self._tag)
            if verify and reader.verifiable:
                checking.append(asyncio.ensure_future(self._run_blocking(
                    _check, reader, [records[at] for at in ats], views)))
        for found in await asyncio.gather(*checking):
            errors.extend(found)
        if failed is not None:
            raise StorageError(f"load: rank {src} read items this rank needs and could not: "
                               f"{failed}", path=reader.path, errno=None)


def _by_receiver(plan: SharePlan, index: dict[int, int], jobs: Sequence[ReadJob]
                 ) -> dict[int, list[tuple[int, ReadJob]]]:
    """`jobs` (items this rank reads for others) by the ranks that receive them, each with its
    place in the manifest."""
    by_peer: dict[int, list[tuple[int, ReadJob]]] = {}
    for job in jobs:
        at = index[id(job.record)]
        for peer in plan.receivers[at]:
            by_peer.setdefault(peer, []).append((at, job))
    return by_peer


def _check(reader: ItemReader, records: Sequence[ItemRecord], views: Sequence[memoryview]
           ) -> list[CorruptCheckpointError]:
    """Blocks: the error of each received item whose digest differs."""
    found = []
    for record, view in zip(records, views, strict=True):
        if record.checksum is not None:
            error = reader.digest_error(record, digest(view))
            if error is not None:
                found.append(error)
    return found


def _batches(jobs: list[ReadJob]) -> list[list[ReadJob]]:
    """`jobs` in file order, cut into batches of about `_BATCH_BYTES`."""
    ordered = sorted(jobs, key=lambda job: (job.record.file, job.record.offset))
    batches: list[list[ReadJob]] = []
    size = _BATCH_BYTES
    for job in ordered:
        if size >= _BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(job)
        size += job.record.nbytes
    return batches


def _plan(gathered: Sequence[bytes], records: Sequence[ItemRecord]) -> SharePlan:
    """Blocks: `_assign` for the manifest's `records`."""
    sizes = np.array([record.nbytes for record in records], dtype=np.int64)
    order = sorted(range(len(records)), key=lambda at: (records[at].file, records[at].offset))
    return _assign(gathered, order, sizes)


def _assign(gathered: Sequence[bytes], order: Sequence[int], sizes: np.ndarray) -> SharePlan:
    """Blocks: the plan for every rank's needs (packed bools per record): the items a set of
    ranks needs, taken in file order (`order`: the records' indices so sorted), are cut into
    one contiguous run per rank (so its reads coalesce into few requests), each run sized so
    that every rank ends with about as many bytes to read, its own items counted."""
    count = len(sizes)
    need = np.stack([np.unpackbits(np.frombuffer(packed, dtype=np.uint8), count=count)
                     .astype(bool) for packed in gathered])
    needers = need.sum(axis=0)
    alone = (needers == 1) | (sizes < _MIN_SHARED_BYTES)
    loads = [int(x) for x in (need & alone).astype(np.int64) @ sizes]
    ordered = np.asarray(order, dtype=np.int64)
    shared = ordered[~alone[ordered] & (needers[ordered] >= 2)]
    masks = np.packbits(need[:, shared], axis=0, bitorder="little")
    groups: dict[bytes, list[int]] = {}
    for column, at in enumerate(shared.tolist()):
        groups.setdefault(masks[:, column].tobytes(), []).append(at)
    readers: dict[int, int] = {}
    receivers: dict[int, tuple[int, ...]] = {}
    for ats in sorted(groups.values(), key=lambda ats: -int(sizes[ats].sum())):
        ranks = np.flatnonzero(need[:, ats[0]]).tolist()
        level = (int(sizes[ats].sum()) + sum(loads[rank] for rank in ranks)) / len(ranks)
        quotas = {rank: max(0.0, level - loads[rank]) for rank in ranks}
        turn = iter(sorted(ranks, key=lambda rank: (loads[rank], rank)))
        rank = next(turn)
        taken = 0.0
        for at in ats:
            size = int(sizes[at])
            while taken + size / 2 > quotas[rank]:  # this run is full: the next rank's
                following = next(turn, None)
                if following is None:
                    break
                rank, taken = following, 0.0
            readers[at] = rank
            receivers[at] = tuple(other for other in ranks if other != rank)
            loads[rank] += size
            taken += size
    return SharePlan(readers, receivers)


async def _all(works: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Await every one of `works`, concurrently; raise the first error once all ended."""
    tasks = [asyncio.ensure_future(work) for work in works]
    if not tasks:
        return
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if failures:
        raise first_error(BaseExceptionGroup("shared reads", failures))
