"""The restore: every rank agrees on the newest step that is complete somewhere for every
rank's shard, then reads its own shard from the nearest tier that verifies.

Rounds, every rank at once (each ends in one all-gather of who has its state):
1. own: a rank whose node holds its shard loads it from there, every item's digest checked;
2. replica, once per other holder: a rank still without its state gets its shard streamed
   by a rank of a node that holds it, over torch.distributed, into its own local tier
   (repairing it: a damaged copy is replaced), and loads it from there, checked;
3. store: a rank still without it loads its share of the store's checkpoint of the step.
A missing, partial or corrupt copy is skipped with a log line naming it, never used. If a
rank's shard verifies nowhere, every rank goes to the next older step (the store's are
listed once, by one rank, only then); with none left, the error names what each tier held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from asynctron.comm import PeerChannel
from asynctron.engine._collectives import Collectives
from asynctron.engine._coordinator import describe
from asynctron.engine._resources import SaveResources
from asynctron.engine.tiers._config import Nodes
from asynctron.engine.tiers._layout import (
    join,
    parse_shard,
    parse_step,
    rank_view,
    shard_name,
    step_name,
)
from asynctron.engine.tiers._stream import (
    Chunk,
    ReceiveBuffers,
    ShardSender,
    receive_shard,
    shard_files,
)
from asynctron.errors import (
    AsynctronError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PeerError,
    StorageError,
)
from asynctron.storage import CheckpointStorage, FileStorage, store_operation

logger = logging.getLogger(__name__)

Source = Literal["local", "replica", "store"]
LoadInto = Callable[[Mapping[str, Any], str, str | None], Awaitable[dict[str, Any]]]
"""`engine.load_into(state, path)` with every digest verified, reading the manifest file
given (a rank's view of a drained step) instead of the checkpoint's own if not None."""

_RESTORE_TAG = 1 << 24
"""Restore streams' tags, above any save's."""
_TIER_FAILURES = (CorruptCheckpointError, CheckpointNotFoundError, StorageError, PeerError,
                  FileNotFoundError)
"""What makes a rank skip a tier and try the next; anything else (a state that does not
match the checkpoint) fails the restore on every rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreResult:
    """What `Engine.restore` restored. Not constructed directly."""

    step: int
    """The step restored: the same on every rank."""
    source: Source
    """Where this rank's shard came from: its node's local tier, a replica on another node
    (streamed over torch.distributed), or the store."""
    sources: tuple[Source, ...]
    """Where each rank's came from, by rank."""
    state: dict[str, Any]
    """The state's structure holding its own tensors (filled in place) and the saved values
    of its other leaves (steps, RNG states, a loader's position), as `load_into` returns."""
    skipped: tuple[str, ...]
    """Every copy this rank did not use, and why (each also logged)."""
    restore_s: float


@dataclass(slots=True)
class RestoreContext:
    """What a restore works with: this rank's place, its tiers, the collectives, the doors."""

    nodes: Nodes
    replicas: int
    local: CheckpointStorage
    local_files: FileStorage
    local_root: str
    store: CheckpointStorage | None
    store_root: str | None
    agree: Collectives
    channel: PeerChannel | None
    resources: SaveResources
    buffers: ReceiveBuffers
    load_into: LoadInto


async def restore(state: Mapping[str, Any], ctx: RestoreContext, *,
                  step: int | None = None) -> RestoreResult:
    """Restore `state` in place from the newest step (or `step`) complete for every rank.

    Raises:
        CheckpointNotFoundError: no step verifies for every rank on any tier (the message
            names what each tier held).
        PeerError: a rank failed (a state that does not match the checkpoint) or is gone.
    """
    started = time.perf_counter()
    nodes, rank = ctx.nodes, ctx.nodes.rank
    held = await _inventory(ctx)
    inventories = await ctx.agree.all_gather_object(held)
    holders: dict[tuple[int, int], list[int]] = {}  # (step, rank) -> nodes holding it
    for node in range(nodes.num_nodes):
        for shard in inventories[node * nodes.ranks_per_node]:
            holders.setdefault(tuple(shard), []).append(node)  # type: ignore[arg-type]
    complete = sorted({s for s, _ in holders if all(
        (s, r) in holders for r in range(nodes.world_size))}, reverse=True)
    if step is not None:
        complete = [s for s in complete if s == step]
    skipped: list[str] = []
    tried: set[int] = set()
    store_steps: list[int] | None = None
    candidates = list(complete)
    while True:
        if not candidates:
            if store_steps is None and ctx.store is not None:
                store_steps = await _store_steps(ctx)
                candidates = [s for s in store_steps if s not in tried
                              and (step is None or s == step)]
            if not candidates:
                raise CheckpointNotFoundError(_nothing_left(inventories, nodes, ctx,
                                                            store_steps, skipped, step),
                                              path=ctx.local_root)
        candidate = candidates.pop(0)
        tried.add(candidate)
        outcome = await _try_step(state, candidate, holders, ctx, skipped,
                                  store=store_steps is None or candidate in store_steps)
        if outcome is not None:
            loaded, sources = outcome
            await _forget_newer(candidate, ctx)
            logger.info("restored step %d: rank %d from %s (ranks: %s)", candidate, rank,
                        sources[rank], ", ".join(sources))
            return RestoreResult(step=candidate, source=sources[rank], sources=sources,
                                 state=loaded, skipped=tuple(skipped),
                                 restore_s=time.perf_counter() - started)


async def _inventory(ctx: RestoreContext) -> list[tuple[int, int]]:
    """The shards this rank's node holds (committed; not yet verified)."""
    names = await ctx.local.list_checkpoints(ctx.local_root)
    return sorted(shard for name in names if (shard := parse_shard(name)) is not None)


async def _store_steps(ctx: RestoreContext) -> list[int]:
    """The store's steps, newest first: one listing, by rank 0, shared (a store that does not
    answer within its deadline counts as empty, said in the log)."""
    assert ctx.store is not None and ctx.store_root is not None
    found: list[int] | str = []
    if ctx.agree.rank == 0:
        try:
            with store_operation("restore listing", ctx.store_root):
                names = await ctx.store.list_checkpoints(ctx.store_root)
            found = sorted((s for n in names if (s := parse_step(n)) is not None),
                           reverse=True)
        except Exception as error:
            found = describe(error)
    found = await ctx.agree.broadcast_object(found, src=0)
    if isinstance(found, str):
        logger.warning("restore: the store %s could not be listed (%s); restoring from the "
                       "local tiers and replicas only", ctx.store_root, found)
        return []
    return found


class _Rank:
    """This rank during one step's rounds: what it loaded, from where, and an error that is no
    tier's fault (a state that does not match the checkpoint: every rank then stops)."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None
        self.source: Source | None = None
        self.fatal: Exception | None = None


async def _try_step(state: Mapping[str, Any], step: int,
                    holders: dict[tuple[int, int], list[int]], ctx: RestoreContext,
                    skipped: list[str], *, store: bool) -> tuple[dict[str, Any],
                                                               tuple[Source, ...]] | None:
    """Every round for `step`; each rank's state and source, or None if a rank's shard
    verified nowhere (every rank then tries an older step).

    Raises:
        ValueError, TypeError, ...: this rank's state does not match the checkpoint (no tier
            can help); PeerError naming the rank, on every other rank.
    """
    nodes, rank = ctx.nodes, ctx.nodes.rank
    world = nodes.world_size
    me = _Rank()
    if nodes.node in holders.get((step, rank), []):
        await _load(me, "local", state, join(ctx.local_root, shard_name(step, rank)), ctx,
                    skipped, "local tier")
    sources = await _gather(ctx, me)
    attempt = 0
    while None in sources:
        pairs = {r: _holder(step, r, attempt, holders, nodes) for r in range(world)
                 if sources[r] is None}
        pairs = {r: sender for r, sender in pairs.items() if sender is not None}
        if not pairs:
            break
        if ctx.channel is None:
            break
        await _replica_round(me, state, step, pairs, attempt, ctx, skipped)
        sources = await _gather(ctx, me)
        attempt += 1
    if None in sources and store and ctx.store is not None and ctx.store_root is not None:
        if me.source is None:
            await _load(me, "store", state, join(ctx.store_root, step_name(step)), ctx,
                        skipped, "store", view=rank_view(rank))
        sources = await _gather(ctx, me)
    if None in sources:
        missing = [r for r, found in enumerate(sources) if found is None]
        skipped.append(f"step {step}: no tier verified the shards of ranks {missing}")
        logger.warning("restore: step %d skipped: no tier verified the shards of ranks %s; "
                       "trying an older step", step, missing)
        return None
    assert me.loaded is not None
    return me.loaded, tuple(sources)  # type: ignore[arg-type]


async def _replica_round(me: _Rank, state: Mapping[str, Any], step: int,
                         pairs: dict[int, int], attempt: int, ctx: RestoreContext,
                         skipped: list[str]) -> None:
    """Holders stream shards to the ranks in `pairs` (receiver -> sender); each receiver
    loads what it got."""
    rank, channel = ctx.nodes.rank, ctx.channel
    assert channel is not None
    tag = _RESTORE_TAG + step % (1 << 20) * 8 + attempt % 8

    async def send(to: int) -> None:
        shard = join(ctx.local_root, shard_name(step, to))
        try:
            await send_shard(channel, to, step, to, shard, ctx, tag=tag)
        except PeerError as error:
            logger.warning("restore: sending rank %d's shard of step %d failed: %s", to, step,
                           error)

    async def receive(sender: int) -> None:
        try:
            received = await receive_shard(channel, sender, tag=tag, storage=ctx.local,
                                           root=ctx.local_root, buffers=ctx.buffers)
        except (*_TIER_FAILURES, OSError) as error:
            _skip(skipped, f"step {step}: the replica on rank {sender}'s node: {error}")
            return
        if received is None:
            _skip(skipped, f"step {step}: the replica on rank {sender}'s node could not be "
                           "read there")
            return
        await _load(me, "replica", state, received.path, ctx, skipped,
                    f"replica from rank {sender}")

    async with asyncio.TaskGroup() as group:
        for to, sender in pairs.items():
            if sender == rank:
                group.create_task(send(to))
        if rank in pairs:
            group.create_task(receive(pairs[rank]))


async def send_shard(channel: PeerChannel, dst: int, step: int, rank: int, shard: str,
                     ctx: RestoreContext, *, tag: int) -> None:
    """Stream the committed `shard` (rank `rank`'s of `step`, from this node's local tier)
    to `dst`, file by file from its bytes on disk; a copy that cannot be read here is sent as
    not committed (the receiver skips it)."""
    sender = ShardSender(channel, [dst], tag=tag, step=step, rank=rank,
                         turn=contextlib.nullcontext())
    manifest: bytes | None = None
    try:
        files, raw = await shard_files(ctx.local, shard)
        for name, nbytes in files.items():
            await _send_file(sender, join(shard, name), name, nbytes, ctx)
        manifest = raw
    except (AsynctronError, OSError) as error:
        if isinstance(error, PeerError):
            raise
        logger.warning("restore: rank %d's shard of step %d here (%s) could not be read: %s",
                       rank, step, shard, error)
    await sender.end(manifest)


async def _send_file(sender: ShardSender, path: str, name: str, nbytes: int,
                     ctx: RestoreContext) -> None:
    run_blocking = ctx.resources.run_blocking
    source = await run_blocking(ctx.local_files.open_file, path)
    try:
        if nbytes == 0:
            await sender.send(name, 0, [])
        offset = 0
        while offset < nbytes:
            buffer = await ctx.buffers.take()
            try:
                size = min(buffer.nbytes, nbytes - offset)
                got = await run_blocking(source.pread_into, buffer[:size], offset)
                if got != size:
                    raise CorruptCheckpointError(
                        f"file {path}: expected {nbytes} bytes, found {offset + got}; it is "
                        "truncated", path=path, offset=offset + got)
                await sender.send(name, nbytes, [Chunk(offset, size, buffer[:size])])
            finally:
                ctx.buffers.give(buffer)
            offset += size
    finally:
        await run_blocking(source.close)


async def _load(me: _Rank, source: Source, state: Mapping[str, Any], path: str,
                ctx: RestoreContext, skipped: list[str], tier: str,
                view: str | None = None) -> None:
    """Load `state` from `path` (through the manifest `view`, if given), every digest
    checked, and say so in `me`; a copy missing, damaged or unreachable is skipped with a
    log line naming it and what was wrong."""
    try:
        me.loaded, me.source = await ctx.load_into(state, path, view), source
    except _TIER_FAILURES as error:
        _skip(skipped, f"{tier} {path}: {error}")
    except Exception as error:  # no tier can help; every rank stops at the next gather
        me.fatal = error


def _skip(skipped: list[str], what: str) -> None:
    skipped.append(what)
    logger.warning("restore: skipping %s", what)


async def _gather(ctx: RestoreContext, me: _Rank) -> list[Source | None]:
    """Every rank's source so far; raise if any rank failed for a reason no tier can fix."""
    found = await ctx.agree.all_gather_object(
        (me.source, None if me.fatal is None else describe(me.fatal)))
    if me.fatal is not None:
        raise me.fatal
    for rank, (_, fatal) in enumerate(found):
        if fatal is not None:
            raise PeerError(f"restore: rank {rank} failed: {fatal}", rank=rank)
    return [source for source, _ in found]


def _holder(step: int, rank: int, attempt: int, holders: dict[tuple[int, int], list[int]],
            nodes: Nodes) -> int | None:
    """The rank that streams `rank`'s shard of `step` on replica attempt `attempt`: the
    same local rank on the attempt-th other node that holds it; None when none is left."""
    others = [node for node in holders.get((step, rank), []) if node != nodes.node_of(rank)]
    if attempt >= len(others):
        return None
    return others[attempt] * nodes.ranks_per_node + rank % nodes.ranks_per_node


async def _forget_newer(step: int, ctx: RestoreContext) -> None:
    """Remove this rank's shards (its own, and the replicas it holds) of steps after the one
    restored: an earlier life's, incomplete or damaged; training saves them again."""
    nodes = ctx.nodes
    mine = {nodes.rank, *nodes.sources(nodes.rank, ctx.replicas)}
    for found_step, rank in await _inventory(ctx):
        if found_step > step and rank in mine:
            await ctx.local.remove_checkpoint(join(ctx.local_root,
                                                   shard_name(found_step, rank)))


def _nothing_left(inventories: list[list[tuple[int, int]]], nodes: Nodes, ctx: RestoreContext,
                  store_steps: list[int] | None, skipped: list[str], step: int | None) -> str:
    held = "; ".join(
        f"node {node}: " + (", ".join(f"step {s} rank {r}" for s, r in
                                      inventories[node * nodes.ranks_per_node]) or "nothing")
        for node in range(nodes.num_nodes))
    store = ("none configured" if ctx.store is None else
             f"steps {store_steps}" if store_steps else "nothing (or it did not answer)")
    wanted = "" if step is None else f" {step}"
    why = f"; skipped: {' | '.join(skipped[-6:])}" if skipped else ""
    return (f"restore: expected a step{wanted} complete for all {nodes.world_size} ranks on a "
            f"tier that verifies, found none; local tiers held: {held}; the store held: "
            f"{store}{why}")
