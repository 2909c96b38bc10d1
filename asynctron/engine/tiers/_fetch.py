"""Items fetched from another node's tier at restore: a rank whose node lacks part of its state
asks a rank of another node, which answers from its node's catalog, over torch.distributed
(a `PeerChannel`). The bytes land straight in the asking rank's tensors where they can (a
whole chunk into a contiguous CPU target); nothing is written to a tier on the way.

One exchange, on one tag (each message a JSON `meta` message, and for data a second message
whose payload is the bytes, so the receiver picks where they land before they arrive):

    client -> server   want    {keys: [[key, origin, shape], ...], structure_of: rank|None}
    server -> client   have    {missing: [keys it holds no whole copy of], structure}
                       items   {records, bad}      + data: whole records back to back
                       piece   {record, start, nbytes, last, bad}  + data: a large record's
                       ...                                           piece
                       end

Every record is checked where it lands: the client hashes what it received against the
record's digest, so a copy damaged on the serving node's disk or on the way is caught there
(the server reads without a second pass over the bytes, and marks `bad` what it could not
read). A key is fetched when every chunk the server sent of it verified.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asynctron._concurrency import RunBlocking
from asynctron._memory import tensor_bytes
from asynctron.comm import PeerChannel
from asynctron.engine.tiers._catalog import SHARD_FAILURES, NodeCatalog
from asynctron.engine.tiers._stream import ReceiveBuffers
from asynctron.storage import ItemRecord
from asynctron.storage.format import NUMPY_DTYPES, TORCH_DTYPES, ItemHasher, ReadJob, Structure


@dataclass(frozen=True, slots=True)
class Want:
    """A key a rank still needs: its local tensor (None for bytes), the global tensor's shape
    and the box of it the local tensor holds (`origin`, `shape`)."""

    key: str
    local: torch.Tensor | None
    global_shape: tuple[int, ...]
    origin: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(slots=True)
class Fetched:
    """What one exchange brought: the keys fetched whole and verified, bytes values, the keys
    the server sent but that failed (and why), the structure asked for, the bytes received."""

    done: set[str] = field(default_factory=set)
    values: dict[str, bytes] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    structure: Structure | None = None
    nbytes: int = 0


async def fetch_items(channel: PeerChannel, server: int, wants: Sequence[Want], *, tag: int,
                      structure_of: int | None, buffers: ReceiveBuffers,
                      run_blocking: RunBlocking) -> Fetched:
    """Ask rank `server` for `wants` (and the saved structure of rank `structure_of`); fill
    the wanted tensors in place as their chunks arrive.

    Raises:
        PeerError: the server is gone.
        ValueError: a chunk the server holds does not match the wanted tensor (dtype or
            shape: the state does not match the checkpoint), after the exchange ends.
    """
    by_key = {want.key: want for want in wants}
    request = json.dumps({"keys": [[w.key, list(w.origin), list(w.shape)] for w in wants],
                          "structure_of": structure_of}).encode()
    await channel.send(server, {"kind": "want", "sizes": [len(request)]},
                       [memoryview(request)], tag=tag)
    have = await _receive_meta(channel, server, tag)
    fetched = Fetched(structure=have["structure"])
    served = set(by_key) - set(have["missing"])
    landing = _Landing(by_key, fetched, run_blocking)
    settling: list[asyncio.Task[None]] = []  # a batch is checked while the next one lands

    async def settle(batch: _Batch, buffer: memoryview) -> None:
        try:
            await landing.settle(batch)
        finally:
            buffers.give(buffer)

    try:
        while True:
            meta = await _receive_meta(channel, server, tag)
            if meta["kind"] == "end":
                break
            if meta["kind"] == "items":
                buffer = await buffers.take()
                try:
                    batch = landing.batch([_record(raw) for raw in meta["records"]],
                                          set(meta["bad"]), buffer)
                    await _receive_into(channel, server, tag, batch.views)
                except BaseException:
                    buffers.give(buffer)
                    raise
                settling.append(asyncio.ensure_future(settle(batch, buffer)))
            else:
                await landing.piece(channel, server, tag, meta, buffers)
    finally:
        await asyncio.gather(*settling, return_exceptions=True)
    for task in settling:
        task.result()
    await landing.finish()
    if landing.mismatch is not None:
        raise landing.mismatch
    fetched.done = served - set(fetched.failed)
    return fetched


class _Landing:
    """Where fetched chunks land on the client, and their digests checked there."""

    def __init__(self, wants: dict[str, Want], fetched: Fetched,
                 run_blocking: RunBlocking) -> None:
        self._wants = wants
        self._fetched = fetched
        self._run_blocking = run_blocking
        self._pieces: dict[tuple[str, tuple[int, ...] | None], _Pieces] = {}
        self.mismatch: ValueError | None = None

    def _fail(self, key: str, why: str) -> None:
        self._fetched.failed.setdefault(key, why)

    def _check(self, record: ItemRecord) -> Want | None:
        """The want `record` is for, if it fits it (else the mismatch is kept, raised last)."""
        want = self._wants.get(record.key)
        if want is None:
            self._fail(record.key, "not asked for")
            return None
        local = want.local
        fits = (local is None) == (record.kind == "bytes") and (
            local is None or (record.dtype is not None and _dtype(record) == local.dtype
                              and record.global_shape == want.global_shape))
        if not fits and self.mismatch is None:
            self.mismatch = ValueError(
                f"key {record.key!r}: expected {local.dtype if local is not None else 'bytes'} "
                f"as in the state dict, found {record.kind} {record.dtype} "
                f"{list(record.global_shape or ())} in the checkpoint; restore into a "
                "matching state")
        return want if fits else None

    def batch(self, records: list[ItemRecord], bad: set[int], scratch: memoryview) -> _Batch:
        """Where each record of a batch lands: straight into its target where it lies whole
        in contiguous CPU memory, else (a part wanted, CUDA or strided, bytes, bad or not
        asked for) into `scratch`, placed once checked."""
        batch = _Batch(records)
        at = 0
        for index, record in enumerate(records):
            want = None if index in bad else self._check(record)
            if index in bad:
                self._fail(record.key, "its chunk could not be read on the serving node")
            region = None if want is None or want.local is None else _overlap_region(
                record, want)
            if region is not None and region.device.type == "cpu" and (
                    region.is_contiguous() and tuple(region.shape) == record.shape):
                view = tensor_bytes(region) if record.nbytes else memoryview(b"")
                batch.landed.append((want, view, True))
            else:
                view = scratch[at:at + record.nbytes]
                at += record.nbytes
                batch.landed.append((want, view, False))
            batch.views.append(view)
        self._fetched.nbytes += sum(record.nbytes for record in records)
        return batch

    async def settle(self, batch: _Batch) -> None:
        """Check every record of a landed batch, and place what landed apart."""
        errors = await self._run_blocking(_check_and_place, batch)
        for key, why in errors.items():
            self._fail(key, why)
        for record, (want, view, _) in zip(batch.records, batch.landed, strict=True):
            if want is not None and want.local is None and record.key not in errors:
                self._fetched.values[record.key] = bytes(view)

    async def piece(self, channel: PeerChannel, server: int, tag: int, meta: dict[str, Any],
                    buffers: ReceiveBuffers) -> None:
        """A piece of a large record: received straight into the target where the record
        lies whole in a contiguous CPU target, else into a chunk of its own, placed once
        whole; hashed as it lands."""
        record = _record(meta["record"])
        identity = (record.key, record.chunk_offsets)
        pieces = self._pieces.get(identity)
        if pieces is None:
            want = self._check(record)
            pieces = self._pieces[identity] = _Pieces(record, want)
        start, nbytes = meta["start"], meta["nbytes"]
        destination = pieces.destination(start, nbytes)
        if destination is None:
            buffer = await buffers.take()
            try:
                await _receive_data(channel, server, tag, buffer, nbytes)
            finally:
                buffers.give(buffer)
        else:
            await _receive_data(channel, server, tag, destination, nbytes)
            self._fetched.nbytes += nbytes
            pieces.hashing = asyncio.ensure_future(_hash_after(
                pieces.hashing, pieces.hasher, destination, self._run_blocking))
        if meta["last"]:
            del self._pieces[identity]
            await self._finish_record(pieces, bool(meta["bad"]))

    async def _finish_record(self, pieces: _Pieces, bad: bool) -> None:
        record = pieces.record
        if pieces.hashing is not None:
            await pieces.hashing
        if bad:
            self._fail(record.key, "its chunk could not be read on the serving node")
        elif pieces.want is None:
            return
        elif record.checksum is not None and pieces.hasher.hexdigest() != record.checksum:
            self._fail(record.key, f"chunk at {list(record.chunk_offsets or ())}: expected "
                                   f"xxh3_64 {record.checksum}, received "
                                   f"{pieces.hasher.hexdigest()}")
        elif isinstance(pieces.chunk, bytearray):
            self._fetched.values[record.key] = bytes(pieces.chunk)
        elif pieces.chunk is not None:
            await self._run_blocking(_place, record, pieces.want, pieces.chunk)

    async def finish(self) -> None:
        for pieces in self._pieces.values():  # a stream that ended early: never whole
            if pieces.hashing is not None:
                await pieces.hashing
            self._fail(pieces.record.key, "the server's stream ended mid-chunk")


@dataclass(slots=True, eq=False)
class _Pieces:
    """A large record arriving in pieces: where they land, its running digest."""

    record: ItemRecord
    want: Want | None
    hasher: ItemHasher = field(default_factory=ItemHasher)
    hashing: asyncio.Future[None] | None = None
    chunk: torch.Tensor | bytearray | None = None
    """Where the record lands whole, to be placed (or, for bytes, kept) once verified; None
    when it lands in its target straight."""
    direct: memoryview | None = None

    def __post_init__(self) -> None:
        want, record = self.want, self.record
        if want is None:
            return
        if want.local is None:
            self.chunk = bytearray(record.nbytes)
            self.direct = memoryview(self.chunk)
            return
        region = _overlap_region(record, want)
        if region is not None and region.device.type == "cpu" and region.is_contiguous() and (
                tuple(region.shape) == record.shape):
            self.direct = tensor_bytes(region)
        else:
            assert record.shape is not None
            self.chunk = torch.empty(record.shape, dtype=_dtype(record))
            self.direct = tensor_bytes(self.chunk)

    def destination(self, start: int, nbytes: int) -> memoryview | None:
        """Where the piece [start, +nbytes) lands, or None (not wanted: received apart)."""
        return None if self.direct is None else self.direct[start:start + nbytes]


async def _hash_after(before: asyncio.Future[None] | None, hasher: ItemHasher,
                      view: memoryview, run_blocking: RunBlocking) -> None:
    if before is not None:
        await before
    await run_blocking(hasher.update, view)


@dataclass(slots=True, eq=False)
class _Batch:
    """A batch of whole records as it lands: per record its want (None: dropped), the view it
    lands in, and whether that view is its target's own memory."""

    records: list[ItemRecord]
    landed: list[tuple[Want | None, memoryview, bool]] = field(default_factory=list)
    views: list[memoryview] = field(default_factory=list)


def _check_and_place(batch: _Batch) -> dict[str, str]:
    """Blocks: check each record's bytes against its digest and copy the wanted part of each
    verified one that landed apart into its target; the keys that failed, and why."""
    errors: dict[str, str] = {}
    for record, (want, view, direct) in zip(batch.records, batch.landed, strict=True):
        if want is None:
            continue
        if record.checksum is not None:
            hasher = ItemHasher()
            hasher.update(view)
            if hasher.hexdigest() != record.checksum:
                errors.setdefault(record.key, f"chunk at {list(record.chunk_offsets or ())}: "
                                              f"expected xxh3_64 {record.checksum}, received "
                                              f"{hasher.hexdigest()}")
                continue
        if want.local is not None and not direct:
            assert record.shape is not None
            chunk = torch.frombuffer(view, dtype=_dtype(record)).view(record.shape) if (
                view.nbytes) else torch.empty(record.shape, dtype=_dtype(record))
            _place(record, want, chunk)
    return errors


def _place(record: ItemRecord, want: Want, chunk: torch.Tensor) -> None:
    """Blocks: copy the part of `record`'s chunk that `want` holds into its target."""
    region = _overlap_region(record, want)
    if region is None:
        return
    assert record.chunk_offsets is not None
    lo = [max(o, r) for o, r in zip(want.origin, record.chunk_offsets, strict=True)]
    source = chunk
    for dim, (start, size) in enumerate(zip(lo, region.shape, strict=True)):
        source = source.narrow(dim, start - record.chunk_offsets[dim], size)
    if region.data_ptr() != source.data_ptr():
        region.copy_(source)


def _overlap_region(record: ItemRecord, want: Want) -> torch.Tensor | None:
    """The part of `want`'s target that `record`'s chunk covers, or None if none."""
    assert want.local is not None and record.chunk_offsets is not None
    assert record.shape is not None
    region = want.local
    for dim, (origin, size, offset, length) in enumerate(zip(
            want.origin, want.shape, record.chunk_offsets, record.shape, strict=True)):
        lo, hi = max(origin, offset), min(origin + size, offset + length)
        if hi <= lo and size:
            return None
        region = region.narrow(dim, lo - origin, max(hi - lo, 0))
    return region


def _dtype(record: ItemRecord) -> torch.dtype:
    assert record.dtype is not None
    return (TORCH_DTYPES if record.kind == "tensor" else NUMPY_DTYPES)[record.dtype]


async def serve_items(channel: PeerChannel, client: int, catalog: NodeCatalog | None, *,
                      tag: int, buffers: ReceiveBuffers) -> int:
    """Answer rank `client`'s `want` from `catalog` (this node's tier; None: it holds
    nothing of the step): every chunk of each key it holds whole, read with its digest
    checked. Returns the bytes sent.

    Raises:
        PeerError: the client is gone.
    """
    request = json.loads(bytes(await _receive_payload(channel, client, tag)))
    keys: list[tuple[str, list[int], list[int]]] = request["keys"]
    structure_of = request["structure_of"]
    records: list[ItemRecord] = []
    missing: list[str] = []
    for key, origin, shape in keys:
        overlaps = None if catalog is None else catalog.covering(key, origin, shape)
        if overlaps is None:
            missing.append(key)
        else:
            records.extend(overlap.record for overlap in overlaps)
    structure = None if catalog is None or structure_of is None else (
        catalog.structures.get(structure_of))
    await _send_meta(channel, client, tag, {"kind": "have", "missing": missing,
                                            "structure": structure})
    sent = 0
    if catalog is not None:
        sent = await _send_batches(channel, client, tag, catalog, _batches(records,
                                                                           buffers.nbytes),
                                   buffers)
    await _send_meta(channel, client, tag, {"kind": "end"})
    return sent


async def _send_batches(channel: PeerChannel, client: int, tag: int, catalog: NodeCatalog,
                        batches: list[list[ItemRecord]], buffers: ReceiveBuffers) -> int:
    """Every batch, in order: the next one read (its digests checked) while one is sent."""
    ready: asyncio.Queue[tuple[dict[str, Any], memoryview, int] | None] = asyncio.Queue(1)

    async def read_ahead() -> None:
        for batch in batches:
            if len(batch) == 1 and batch[0].nbytes > buffers.nbytes:
                await _read_pieces(catalog, batch[0], buffers, ready)
            else:
                await ready.put(await _read_batch(catalog, batch, buffers))
        await ready.put(None)

    reading = asyncio.ensure_future(read_ahead())
    sent = 0
    try:
        while (message := await ready.get()) is not None:
            meta, buffer, nbytes = message
            sizes = ([record["nbytes"] for record in meta["records"]]
                     if meta["kind"] == "items" else [nbytes])
            pieces, at = [], 0
            for size in sizes:
                pieces.append(buffer[at:at + size])
                at += size
            try:
                await _send_meta(channel, client, tag, meta)
                await channel.send(client, {"kind": "data", "sizes": sizes}, pieces, tag=tag)
            finally:
                buffers.give(buffer)
            sent += nbytes
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        while not ready.empty():
            message = ready.get_nowait()
            if message is not None:
                buffers.give(message[1])
    return sent


def _batches(records: Sequence[ItemRecord], nbytes: int) -> list[list[ItemRecord]]:
    """Records in batches of at most `nbytes` (a larger record alone)."""
    batches: list[list[ItemRecord]] = []
    batch: list[ItemRecord] = []
    total = 0
    for record in records:
        if batch and total + record.nbytes > nbytes:
            batches.append(batch)
            batch, total = [], 0
        batch.append(record)
        total += record.nbytes
    if batch:
        batches.append(batch)
    return batches


async def _read_batch(catalog: NodeCatalog, batch: list[ItemRecord], buffers: ReceiveBuffers
                      ) -> tuple[dict[str, Any], memoryview, int]:
    """Whole records back to back into a buffer (a record that cannot be read is marked bad):
    the batch's meta message, the buffer, its bytes."""
    buffer = await buffers.take()
    try:
        jobs, at = [], 0
        for record in batch:
            jobs.append(ReadJob(record, buffer[at:at + record.nbytes]))
            at += record.nbytes
        try:
            await catalog.read(jobs, verify=False, slab_bytes=buffers.nbytes)
            bad: list[int] = []
        except SHARD_FAILURES:
            bad = list(range(len(batch)))
    except BaseException:
        buffers.give(buffer)
        raise
    return ({"kind": "items", "records": [_record_json(record) for record in batch],
             "bad": bad, "nbytes": at}, buffer, at)


async def _read_pieces(catalog: NodeCatalog, record: ItemRecord, buffers: ReceiveBuffers,
                       ready: asyncio.Queue[tuple[dict[str, Any], memoryview, int] | None]
                       ) -> None:
    """A record larger than a buffer, piece by piece into `ready` (the last piece's meta says
    whether it could all be read)."""
    bad = False
    start = 0
    while start < record.nbytes:
        nbytes = min(buffers.nbytes, record.nbytes - start)
        buffer = await buffers.take()
        try:
            if not bad:
                try:
                    await catalog.read_range(record, start, buffer[:nbytes], None)
                except SHARD_FAILURES:
                    bad = True
        except BaseException:
            buffers.give(buffer)
            raise
        await ready.put(({"kind": "piece", "record": _record_json(record), "start": start,
                          "nbytes": nbytes, "last": start + nbytes == record.nbytes,
                          "bad": bad}, buffer, nbytes))
        start += nbytes


def _record_json(record: ItemRecord) -> dict[str, Any]:
    return {"key": record.key, "kind": record.kind, "dtype": record.dtype,
            "shape": record.shape, "global_shape": record.global_shape,
            "chunk_offsets": record.chunk_offsets, "nbytes": record.nbytes,
            "checksum": record.checksum}


def _record(raw: dict[str, Any]) -> ItemRecord:
    def dims(value: Any) -> tuple[int, ...] | None:
        return None if value is None else tuple(int(v) for v in value)

    return ItemRecord(key=str(raw["key"]), kind=raw["kind"], file="", offset=0,
                      nbytes=int(raw["nbytes"]), checksum=raw["checksum"], dtype=raw["dtype"],
                      shape=dims(raw["shape"]), global_shape=dims(raw["global_shape"]),
                      chunk_offsets=dims(raw["chunk_offsets"]))


async def _send_meta(channel: PeerChannel, dst: int, tag: int, meta: dict[str, Any]) -> None:
    payload = json.dumps(meta, separators=(",", ":")).encode()
    await channel.send(dst, {"kind": "meta", "sizes": [len(payload)]}, [memoryview(payload)],
                       tag=tag)


async def _receive_meta(channel: PeerChannel, src: int, tag: int) -> dict[str, Any]:
    return json.loads(bytes(await _receive_payload(channel, src, tag)))


async def _receive_payload(channel: PeerChannel, src: int, tag: int) -> memoryview:
    """The payload of the next message from `src`, in memory of its own."""
    small = memoryview(bytearray(1 << 16))
    header, got = await channel.receive(src, small, tag=tag)
    nbytes = sum(int(size) for size in header.get("sizes", ()))
    if got == nbytes:
        return small[:nbytes]
    whole = memoryview(bytearray(nbytes))
    await channel.receive_into(src, [whole], tag=tag)
    return whole


async def _receive_data(channel: PeerChannel, src: int, tag: int, into: memoryview,
                        nbytes: int) -> int:
    """The next data message from `src` (of `nbytes`) into `into`."""
    await _receive_into(channel, src, tag, [into[:nbytes]])
    return nbytes


async def _receive_into(channel: PeerChannel, src: int, tag: int,
                        views: Sequence[memoryview]) -> None:
    """The next data message from `src`, its payload's pieces into `views` (one each)."""
    header, _ = await channel.receive(src, memoryview(b""), tag=tag)
    sizes = [int(size) for size in header.get("sizes", ())]
    if header.get("kind") != "data" or sizes != [view.nbytes for view in views]:
        raise ValueError(f"restore stream from rank {src}: expected data of "
                         f"{[view.nbytes for view in views]} bytes, found "
                         f"{_describe_header(header)}")
    if sum(sizes):
        await channel.receive_into(src, views, tag=tag)


def _describe_header(header: dict[str, Any]) -> str:
    return f"a {header.get('kind')!r} message of {sum(header.get('sizes', ()))} bytes"

