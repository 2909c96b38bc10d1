"""The restore: every rank agrees on the newest step some tier holds whole, then fills its state
from the nearest copies that verify, item by item.

A step's items are spread over the nodes' tiers (each node holds one copy of what its ranks
need, the replicas what no other node has) and the store. Rounds, every rank at once (each
ends in one all-gather of who still needs what):
1. local: a rank fills every key its node's catalog of the step covers (`NodeCatalog`: its
   node's shards and the replicas they keep), every digest checked;
2. peers, once per other node that holds part of the step: a rank still missing keys asks
   the same local rank of that node, which sends the chunks its node holds whole
   (`_fetch`), checked where they are read and where they land, straight into the tensors;
3. store: a rank still missing keys fills them from the store's checkpoint of the step; with
   `EngineConfig.share_reads` (the default on object stores), each item the ranks need is
   read once per job and sent to the other ranks that need it (`ReadShare`).
A copy missing, partial or corrupt is skipped with a log line naming it, never used; if a
rank's state is still not whole, every rank goes to the next older step (the store's are
listed once, by one rank, only then). The ranks' layout may differ from the saving job's
(another world size, other DTensor shardings): keys are filled from whatever chunks cover
them, as `load_into` reshards.

What a restore finds when nothing is restored is three different answers: nothing was ever
saved (no tier holds a shard, the store answered that it holds no step): a first start,
`RestoreResult.step` None; the store did not answer and no local tier could serve: a
`StorageError` naming it, never taken for a first start; steps were saved but none can be
restored: `CheckpointNotFoundError` naming what each tier held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from asynctron._concurrency import first_error
from asynctron.comm import PeerChannel
from asynctron.engine._collectives import Collectives
from asynctron.engine._coordinator import describe
from asynctron.engine._load import Loads, rebuild, target_box
from asynctron.engine._shared_reads import ReadShare
from asynctron.engine.tiers._catalog import SHARD_FAILURES, NodeCatalog, saved_keys, skip
from asynctron.engine.tiers._config import Nodes
from asynctron.engine.tiers._fetch import Want, fetch_items, serve_items
from asynctron.engine.tiers._layout import (
    join,
    parse_shard,
    parse_step,
    rank_view,
    shard_name,
    step_name,
)
from asynctron.engine.tiers._stream import ReceiveBuffers
from asynctron.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PeerError,
    StorageError,
)
from asynctron.storage import Manifest, store_operation
from asynctron.storage.backends import CheckpointReader, CheckpointStorage
from asynctron.storage.format import (
    MAX_MANIFEST_BYTES,
    FlatStateDict,
    Structure,
    flatten,
    parse_manifest,
)

logger = logging.getLogger(__name__)

Source = Literal["local", "replica", "store"]
"""Where a rank's bytes came from: its node's tier, another node's (over torch.distributed),
the store. A rank's `source` is the farthest it needed."""
_ORDER: tuple[Source, ...] = ("local", "replica", "store")

_RESTORE_TAG = 1 << 24
"""Restore streams' tags, above any save's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RestoreResult:
    """What `Engine.restore` restored. Not constructed directly."""

    step: int | None
    """The step restored, the same on every rank; None when no tier ever held a step (a
    first start: the state is left as it was)."""
    source: Source | None
    """The farthest tier this rank's state came from: its node's (`"local"`), another node's
    (`"replica"`, over torch.distributed), the store; None on a first start."""
    sources: tuple[Source | None, ...]
    """Each rank's `source`, by rank."""
    state: dict[str, Any]
    """The state's structure holding its own tensors (filled in place) and the saved values
    of its other leaves (steps, a loader's position), as `load_into` returns."""
    nbytes: dict[Source, int]
    """The bytes this rank read from each tier."""
    skipped: tuple[str, ...]
    """Every copy this rank did not use, and why (each also logged)."""
    restore_s: float


@dataclass(slots=True)
class RestoreContext:
    """What a restore works with: this rank's place, its tiers, the collectives, the doors."""

    nodes: Nodes
    local: CheckpointStorage
    local_root: str
    store: CheckpointStorage | None
    store_root: str | None
    agree: Collectives
    channel: PeerChannel | None
    loads: Loads
    """The engine's loads: each round's reads go through a `Loader` it makes."""
    buffers: ReceiveBuffers
    share_store_reads: bool = False
    """Read each of the store's items once per job, sending it to the other ranks that need
    it (every rank then takes part in the store round)."""


async def restore(state: Mapping[str, Any], ctx: RestoreContext, *,
                  step: int | None = None) -> RestoreResult:
    """Restore `state` in place from the newest step (or `step`) some tier holds whole.

    Raises:
        CheckpointNotFoundError: steps were saved, but none verifies whole on any tier (the
            message names what each tier held).
        StorageError: no local tier could serve, and the store did not answer within its
            deadline (naming it): whether a step was saved is unknown.
        PeerError: a rank failed (a state that does not match the checkpoint) or is gone.
        ValueError: this rank's state does not match the checkpoint (naming the key).
    """
    started = time.perf_counter()
    run_blocking = ctx.loads.run_blocking
    target = await run_blocking(flatten, state)
    wants = await run_blocking(_wants, target)
    inventories = await ctx.agree.all_gather_object(await _inventory(ctx))
    nodes = ctx.nodes
    held = [inventories[node * nodes.ranks_per_node] for node in range(nodes.num_nodes)]
    skipped: list[str] = []
    store = _StoreSteps(ctx)
    candidates: list[tuple[int, int | None]] = [
        (s, world) for s, world in _complete(held, nodes.world_size) if step in (None, s)]
    tried: set[int] = set()
    restore_seq = 0
    while True:
        if not candidates:
            if store.listed:
                break
            candidates = [(s, None) for s in await store.steps() if s not in tried
                          and step in (None, s)]
            if not candidates:
                break
        candidate, world = candidates.pop(0)
        tried.add(candidate)
        restore_seq += 1
        rank_state = _RankState(dict(wants))
        outcome = await _try_step(rank_state, target, candidate, world, held, ctx, store,
                                  skipped, tag=_RESTORE_TAG + restore_seq % (1 << 16) * 64)
        if outcome is not None:
            await _forget_newer(candidate, ctx)
            sources = outcome
            logger.info("restore: rank %d: restored step %d from %s (ranks: %s)", nodes.rank,
                        candidate, sources[nodes.rank], ", ".join(map(str, sources)))
            items = {key: target.original(key) for key in target.values}
            items.update(rank_state.values)
            assert rank_state.structure is not None
            restored = rebuild(target.structure, items, rank_state.structure,
                               f"step {candidate}")
            return RestoreResult(step=candidate, source=sources[nodes.rank], sources=sources,
                                 state=restored, nbytes=dict(rank_state.nbytes),
                                 skipped=tuple(skipped),
                                 restore_s=time.perf_counter() - started)
    if store.error is not None:
        raise StorageError(
            f"restore: expected the store {ctx.store_root} to answer, found {store.error}; no "
            f"local tier could serve a step ({_held_words(held, nodes)}), so whether a step "
            "was saved is unknown: this is not a first start; restore again once the store "
            "answers", path=ctx.store_root or "", errno=None)
    if not any(held) and not store.found:
        logger.info("restore: rank %d: no tier holds a step: a first start", nodes.rank)
        return RestoreResult(step=None, source=None, sources=(None,) * nodes.world_size,
                             state=dict(state), nbytes={}, skipped=tuple(skipped),
                             restore_s=time.perf_counter() - started)
    wanted = "" if step is None else f" {step}"
    why = f"; skipped: {' | '.join(skipped[-6:])}" if skipped else ""
    raise CheckpointNotFoundError(
        f"restore: expected a step{wanted} that the tiers hold whole for all "
        f"{nodes.world_size} ranks, found none that verifies; local tiers held: "
        f"{_held_words(held, nodes)}; the store held: {store.words()}{why}",
        path=ctx.local_root)


def _wants(target: FlatStateDict) -> dict[str, Want]:
    """Blocks: every item of the target state, as a rank asks for it."""
    wants = {}
    for key, value in target.values.items():
        if isinstance(value, bytes):
            wants[key] = Want(key, None, (), (), ())
            continue
        local, origin = target_box(value.detach())
        wants[key] = Want(key, local, tuple(value.shape), origin, tuple(local.shape))
    return wants


async def _inventory(ctx: RestoreContext) -> list[tuple[int, int, int]]:
    """The shards this rank's node holds, (step, rank, world size) (committed; not yet
    verified)."""
    names = await ctx.local.list_checkpoints(ctx.local_root)
    return sorted(shard for name in names if (shard := parse_shard(name)) is not None)


def _complete(held: list[list[tuple[int, int, int]]], world_size: int
              ) -> list[tuple[int, int | None]]:
    """The (step, world size) whose every rank's shard some node holds, newest first (at one
    step, the current world's first)."""
    ranks: dict[tuple[int, int], set[int]] = {}
    for shards in held:
        for step, rank, world in shards:
            ranks.setdefault((step, world), set()).add(rank)
    whole = [key for key, found in ranks.items() if len(found) == key[1]]
    return sorted(whole, key=lambda key: (-key[0], key[1] != world_size))


def _held_words(held: list[list[tuple[int, int, int]]], nodes: Nodes) -> str:
    return "; ".join(
        f"node {node}: " + (", ".join(f"step {s} rank {r}/{w}" for s, r, w in shards[:12])
                            + (f" and {len(shards) - 12} more" if len(shards) > 12 else "")
                            or "nothing")
        for node, shards in enumerate(held))


class _StoreSteps:
    """The store's steps, listed once when first needed, by rank 0, for every rank."""

    def __init__(self, ctx: RestoreContext) -> None:
        self._ctx = ctx
        self.listed = ctx.store is None
        self.found: list[int] = []
        """The store's steps, newest first (empty until listed, or when it has none)."""
        self.error: str | None = None
        """Why the store could not be listed, if it could not."""

    async def steps(self) -> list[int]:
        """Collective (every rank at once): the store's steps, newest first."""
        ctx = self._ctx
        if self.listed:
            return self.found
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
        self.listed = True
        if isinstance(found, str):
            self.error = found
            logger.warning("restore: the store %s could not be listed (%s)", ctx.store_root,
                           found)
            return []
        self.found = found
        return found

    def words(self) -> str:
        if self._ctx.store is None:
            return "none configured"
        if not self.listed:
            return "not asked"
        return f"steps {self.found[:12]}" if self.found else "nothing"


@dataclass(slots=True)
class _RankState:
    """This rank during one step's rounds: the keys it still needs, what it found, from
    where, and an error that is no tier's fault (every rank then stops)."""

    wants: dict[str, Want]
    values: dict[str, bytes] = field(default_factory=dict)
    structure: Structure | None = None
    used: set[Source] = field(default_factory=set)
    nbytes: dict[Source, int] = field(default_factory=dict)
    fatal: Exception | None = None

    @property
    def needy(self) -> bool:
        return bool(self.wants) or self.structure is None

    def took(self, source: Source, keys: set[str], nbytes: int) -> None:
        if keys:
            self.used.add(source)
        self.nbytes[source] = self.nbytes.get(source, 0) + nbytes
        for key in keys:
            del self.wants[key]

    @property
    def source(self) -> Source:
        return max(self.used or {"local"}, key=_ORDER.index)


async def _try_step(me: _RankState, target: FlatStateDict, step: int, world: int | None,
                    held: list[list[tuple[int, int, int]]], ctx: RestoreContext,
                    store: _StoreSteps, skipped: list[str], *, tag: int
                    ) -> tuple[Source, ...] | None:
    """Every round for `step` (saved by `world` ranks; None: a step only the store holds);
    each rank's source, or None if a rank's state verified nowhere whole (every rank then
    tries an older step).

    Raises:
        ValueError, TypeError, ...: this rank's state does not match the checkpoint (no tier
            can help); PeerError naming the rank, on every other rank.
    """
    nodes = ctx.nodes
    structure_of = nodes.rank if world in (None, nodes.world_size) else 0
    holding = {node for node, shards in enumerate(held)
               if world is not None and any((s, w) == (step, world) for s, _, w in shards)}
    catalog = None
    if nodes.node in holding:
        assert world is not None
        here = {rank for s, rank, w in held[nodes.node] if (s, w) == (step, world)}
        nearest = sorted(here, key=lambda owner: (owner != structure_of,
                                                  nodes.node_of(owner) != nodes.node
                                                  if world == nodes.world_size else 0, owner))
        catalog = NodeCatalog(ctx.local, ctx.local_root, nearest, step=step, world_size=world,
                              max_files_at_once=ctx.loads.max_files_at_once,
                              skipped=skipped, rank=nodes.rank)
    servers = _servers(holding, nodes) if ctx.channel is not None else []
    attempts = [0] * nodes.world_size
    """Per rank, the next of its servers to ask (the same on every rank)."""
    try:
        # Round 1: every rank fills what its node holds; a rank whose node holds nothing of
        # the step asks its first server meanwhile (that server serves while it fills).
        asking = [nodes.node_of(rank) not in holding and bool(servers)
                  and attempts[rank] < len(servers[rank]) for rank in range(nodes.world_size)]
        local = None if catalog is None else _guard(me, _fill_local(
            me, target, catalog, structure_of, ctx, skipped))
        await _peer_round(me, catalog, asking, servers, attempts, structure_of, ctx, skipped,
                          tag=tag, alongside=local)
        needy = await _gather(ctx, me)
        while True:
            asking = [need and bool(servers) and attempts[rank] < len(servers[rank])
                      for rank, need in enumerate(needy)]
            if not any(asking):
                break
            await _peer_round(me, catalog, asking, servers, attempts, structure_of, ctx,
                              skipped, tag=tag + max(attempts))
            needy = await _gather(ctx, me)
        if any(needy) and step in await store.steps():
            found = await _locate(step, ctx)
            if isinstance(found, _StoreStep) and (me.needy or ctx.share_store_reads):
                await _guard(me, _fill_from_store(me, target, found, ctx, skipped, tag=tag))
            elif me.needy:
                skip(skipped, nodes.rank, found)
            needy = await _gather(ctx, me)
    finally:
        if catalog is not None:
            await catalog.aclose()
    if any(needy):
        missing = [rank for rank, need in enumerate(needy) if need]
        if me.needy:
            values = "" if me.structure is not None else " nor the saved values"
            skip(skipped, nodes.rank, f"step {step}: no tier verified keys "
                                      f"{sorted(me.wants)[:6]}{values} of this rank's state")
        logger.warning("restore: rank %d: step %d skipped: no tier verified the state of ranks "
                       "%s whole; trying an older step", nodes.rank, step, missing)
        return None
    return tuple(await ctx.agree.all_gather_object(me.source))


async def _guard(me: _RankState, work: Awaitable[None]) -> None:
    """Run `work`; an error no tier can fix is kept for the next gather to raise."""
    try:
        await work
    except SHARD_FAILURES:
        raise
    except (ValueError, TypeError) as error:  # the state does not match the checkpoint
        me.fatal = error


async def _fill_local(me: _RankState, target: FlatStateDict, catalog: NodeCatalog,
                      structure_of: int, ctx: RestoreContext, skipped: list[str]) -> None:
    """Fill every key the node's catalog covers whole (its shards opened nearest first, until
    they cover what this rank needs); take the saved structure if there."""
    await catalog.open_until(lambda: structure_of in catalog.structures and all(
        catalog.covering(key, want.origin, want.shape) is not None
        for key, want in me.wants.items()))
    me.structure = catalog.structures.get(structure_of)
    if me.structure is not None and structure_of == ctx.nodes.rank:
        unknown = sorted(set(me.wants) - saved_keys(me.structure))
        if unknown:
            raise ValueError(f"keys {unknown[:6]}: expected in the saved state of step "
                             f"{catalog.step} (rank {structure_of}'s), found no such items; "
                             "restore into the state that was saved")
    covered = {key for key, want in me.wants.items()
               if catalog.covering(key, want.origin, want.shape) is not None}
    if not covered:
        return
    try:
        loader = ctx.loads.loader(catalog, catalog.manifest(), verify=True, whole_chunks=True)
        values, failed = await loader.fill(target, covered)
    except SHARD_FAILURES as error:
        skip(skipped, ctx.nodes.rank, f"local tier {catalog.path}: {describe(error)}")
        return
    for key, why in failed.items():
        skip(skipped, ctx.nodes.rank, f"local tier {catalog.path}: key {key!r}: {why}")
    done = covered - set(failed)
    me.values.update(values)
    me.took("local", done, sum(record.nbytes for key in done
                               for record in catalog.records(key)))


def _servers(holding: set[int], nodes: Nodes) -> list[list[int]]:
    """Per rank, the ranks it asks in turn: the same local rank of each other node that
    holds a shard of the step, nearest (next) node first."""
    servers = []
    for rank in range(nodes.world_size):
        node = nodes.node_of(rank)
        order = [(node + j) % nodes.num_nodes for j in range(1, nodes.num_nodes)]
        servers.append([other * nodes.ranks_per_node + rank % nodes.ranks_per_node
                        for other in order if other in holding])
    return servers


async def _peer_round(me: _RankState, catalog: NodeCatalog | None, asking: list[bool],
                      servers: list[list[int]], attempts: list[int], structure_of: int,
                      ctx: RestoreContext, skipped: list[str], *, tag: int,
                      alongside: Awaitable[None] | None = None) -> None:
    """Every asking rank asks its next server; every server answers its askers; `alongside`
    (this rank's own fill) runs meanwhile. Then each asking rank's next server is the one
    after."""
    rank, channel = ctx.nodes.rank, ctx.channel
    clients = [client for client, ask in enumerate(asking)
               if ask and servers[client][attempts[client]] == rank]

    async def ask(server: int) -> None:
        assert channel is not None
        wants = list(me.wants.values())
        fetched = await fetch_items(channel, server, wants, tag=tag,
                                    structure_of=None if me.structure is not None
                                    else structure_of, buffers=ctx.buffers,
                                    run_blocking=ctx.loads.run_blocking)
        for key, why in fetched.failed.items():
            skip(skipped, ctx.nodes.rank, f"the copy on rank {server}'s node: key {key!r}: "
                                          f"{why}")
        if me.structure is None:
            me.structure = fetched.structure
        me.values.update(fetched.values)
        me.took("replica", fetched.done, fetched.nbytes)

    if clients and catalog is not None:
        await catalog.open_all()  # its askers may need what this rank did not
    serving = ReceiveBuffers(2, ctx.buffers.nbytes)  # apart: a rank may serve and ask at once
    try:
        async with asyncio.TaskGroup() as group:
            if alongside is not None:
                group.create_task(alongside)
            assert channel is not None or not clients
            for client in clients:
                group.create_task(serve_items(channel, client, catalog, tag=tag,
                                              buffers=serving))
            if asking[rank]:
                group.create_task(_guard(me, ask(servers[rank][attempts[rank]])))
    except BaseExceptionGroup as error:
        raise first_error(error) from None
    for client, ask_ in enumerate(asking):
        if ask_:
            attempts[client] += 1


@dataclass(frozen=True, slots=True)
class _StoreStep:
    """The store's checkpoint of a step, as rank 0 found it for every rank: its path, its
    manifest, rank 0's saved structure (its view's) and the saving world's size."""

    path: str
    manifest: Manifest
    structure: Structure
    world_size: int


async def _locate(step: int, ctx: RestoreContext) -> _StoreStep | str:
    """Collective: rank 0 opens the store's checkpoint of `step` (one listing and manifest for
    the job, not one per rank) and tells every rank; or why it could not."""
    assert ctx.store is not None and ctx.store_root is not None
    found: _StoreStep | str = ""
    if ctx.agree.rank == 0:
        path = join(ctx.store_root, step_name(step))
        try:
            with store_operation("restore", path):
                reader = await ctx.store.open_reader(path, max_files_at_once=1)
                try:
                    manifest = await reader.open()
                    view = await _view(reader, reader.path, 0, ctx)
                finally:
                    await reader.aclose()
            assert view.shard is not None
            found = _StoreStep(reader.path, manifest, view.structure, view.shard.world_size)
        except SHARD_FAILURES as error:
            found = f"store {path}: {describe(error)}"
    return await ctx.agree.broadcast_object(found, src=0)


async def _fill_from_store(me: _RankState, target: FlatStateDict, found: _StoreStep,
                           ctx: RestoreContext, skipped: list[str], *, tag: int) -> None:
    """Fill the keys still needed from the store's checkpoint `found`; the saved values from
    this rank's view there (rank 0's, if the saving world was another). With shared reads
    every rank takes part, needy or not."""
    assert ctx.store is not None
    path, manifest = found.path, found.manifest
    nodes = ctx.nodes
    share = None
    if ctx.share_store_reads:
        assert ctx.channel is not None
        share = ReadShare(ctx.agree, ctx.channel, tag=tag,
                          run_blocking=ctx.loads.run_blocking)
    try:
        with store_operation("restore", path):
            reader = await ctx.store.open_reader(
                path, max_files_at_once=ctx.loads.max_files_at_once)
            try:
                reader.adopt(path, manifest)
                if me.needy and me.structure is None:
                    me.structure = found.structure if (
                        nodes.rank == 0 or found.world_size != nodes.world_size) else (
                        await _view(reader, path, nodes.rank, ctx)).structure
                keys = set(me.wants)
                loader = ctx.loads.loader(reader, manifest, verify=True, whole_chunks=True,
                                         share=share)
                values, failed = await loader.fill(target, keys)
            finally:
                await reader.aclose()
    except (*SHARD_FAILURES, PeerError) as error:
        # Another rank's failure (PeerError) is raised by the round's gather, or is its own.
        if share is not None:
            await share.abandon(error)
        skip(skipped, nodes.rank, f"store {path}: {describe(error)}")
        return
    for key, why in failed.items():
        skip(skipped, nodes.rank, f"store {path}: key {key!r}: {why}")
    done = keys - set(failed)
    me.values.update(values)
    me.took("store", done, loader.read_bytes)


async def _view(reader: CheckpointReader, path: str, rank: int, ctx: RestoreContext
                ) -> Manifest:
    """Rank `rank`'s view in a drained step (a shard's manifest: its structure)."""
    name = rank_view(rank)
    view = await ctx.loads.run_blocking(
        parse_manifest, await reader.read_file(name, MAX_MANIFEST_BYTES), join(path, name))
    if view.shard is None or view.shard.rank != rank:
        raise CorruptCheckpointError(f"store {join(path, name)}: expected rank {rank}'s view "
                                     "(a shard's manifest), found another manifest",
                                     path=join(path, name))
    return view


async def _gather(ctx: RestoreContext, me: _RankState) -> list[bool]:
    """Which ranks still need something; raise if any rank failed for a reason no tier can
    fix."""
    found = await ctx.agree.all_gather_object(
        (me.needy, None if me.fatal is None else describe(me.fatal)))
    if me.fatal is not None:
        raise me.fatal
    for rank, (_, fatal) in enumerate(found):
        if fatal is not None:
            raise PeerError(f"restore: rank {rank} failed: {fatal}", rank=rank)
    return [need for need, _ in found]


async def _forget_newer(step: int, ctx: RestoreContext) -> None:
    """On a node's first rank: remove the node's shards of steps after the one restored (an
    earlier life's, incomplete or damaged; training saves them again)."""
    nodes = ctx.nodes
    if nodes.rank % nodes.ranks_per_node:
        return
    for found_step, rank, world in await _inventory(ctx):
        if found_step > step:
            await ctx.local.remove_checkpoint(join(ctx.local_root,
                                                   shard_name(found_step, rank, world)))
