"""`TierManager`: an engine's tiers, owned by the engine: the saves to them, their retention,
the drains to the store, the restore.

One save to the tiers, on every rank at once (`Engine.save(state, step=N)`):
1. this rank's shard is saved into its node's local tier: an asynctron save (plan, stage,
   write, atomic commit) of the items the placement gives it (`_placement`: each item once
   per node, sorted into groups of files), planned with every rank's; the files no other
   node holds are also streamed, from the same staged slabs, to the ranks that keep their
   replicas (`ShardSender`, a `BatchConsumer` of the pipeline), while this rank receives the
   replicas it keeps into its own local tier (`receive_shard`);
2. every rank tells every other whether its shard and the replicas it keeps are committed
   (one all-gather, in save order): the step is complete when all are;
3. then each node's first rank prunes its node's tier beyond `keep_local` complete steps,
   and on a `store_every`-th step the drain to the store starts in the background (skipped,
   on every rank alike, while an earlier drain still runs on any; a failed drain is tried
   again at the next complete step).
The trainer blocks only for the staging (`task.staged`); `await task` is step 2.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from asynctron._concurrency import to_its_end, uncancellable
from asynctron.comm import PeerChannel
from asynctron.engine._collectives import Collectives, SoloCollectives
from asynctron.engine._coordinator import ShardCoordinator, describe
from asynctron.engine._load import Loads
from asynctron.engine._plan_cache import PlanCache
from asynctron.engine._resources import SaveResources
from asynctron.engine._save import SaveJob, SaveOptions
from asynctron.engine._task import SaveResult
from asynctron.engine._turns import Turns
from asynctron.engine.tiers._config import Nodes, Tiers
from asynctron.engine.tiers._drain import drain_step
from asynctron.engine.tiers._layout import join, parse_shard, shard_name
from asynctron.engine.tiers._placement import NodePlacement, part_of
from asynctron.engine.tiers._restore import RestoreContext, RestoreResult, restore
from asynctron.engine.tiers._stream import (
    ReceiveBuffers,
    ShardReceived,
    ShardSender,
    receive_shard,
)
from asynctron.errors import PeerError, StorageError
from asynctron.storage import Backend, Retention
from asynctron.storage.backends import Committer
from asynctron.storage.format import MANIFEST_NAME, parse_manifest

logger = logging.getLogger(__name__)

_TAGS = 1 << 20
"""Save streams' tags cycle through this many (restore streams use tags above)."""
_PROBE = ".asynctron-probe"
"""The checkpoint name whose save area `start` makes and discards in each local tier."""


class TierManager:
    """The tiers of one engine on one rank. Not constructed directly; `Engine` makes one when
    given `tiers`.

    Memory: besides the staging budget, `2 * (replicas + 1)` buffers of `slab_bytes` that
    replicas are received into (and, at restore, streamed from): a receiver never waits for
    staging memory its own save holds.
    Concurrency: saves to the tiers may overlap; each step's agreement runs in save order.
    """

    def __init__(self, tiers: Tiers, nodes: Nodes, *, resources: SaveResources, loads: Loads,
                 local: Backend, store: Backend | None, planning: Collectives,
                 agree: Collectives, drains: Collectives, channel: PeerChannel | None,
                 plan_cache: PlanCache, store_retention: Retention | None) -> None:
        self.tiers = tiers
        self.nodes = nodes
        self.local_files = local
        """The local tier's files (a shard's, streamed to a peer or the store)."""
        self.local = local.checkpoints(resources.run_blocking)
        self.store = None if store is None else store.checkpoints(resources.run_blocking)
        self.local_root = local.locate(tiers.local_root(nodes.node))
        self.store_root = None if store is None or tiers.store is None else (
            store.locate(tiers.store))
        self._share_store_reads = (channel is not None and store is not None
                                   and resources.config.shares_reads(store))
        """Restoring from the store, read each item once per job (`EngineConfig.share_reads`)."""
        self._resources = resources
        self._loads = loads
        self._agree = agree
        self._drains = drains
        self._channel = channel
        self._plan_cache = plan_cache
        self._store_retention = store_retention
        self._shards = ShardCoordinator(planning, SoloCollectives(), resources.run_blocking,
                                        Committer(None, points_latest=False))
        """Each rank commits its own shard, planned with every rank's."""
        self._turns = Turns()
        """The steps' agreements, in save order."""
        self._send_turns = Turns()
        self._receive_turns = {src: Turns() for src in nodes.sources(nodes.rank)}
        """One replica stream to (and one from) each peer at a time, in save order: a thread
        waits on each transfer, so overlapping saves must not multiply them."""
        self._seq = 0
        """Saves to the tiers started (the same on every rank: they are collective)."""
        self._buffers = ReceiveBuffers(2 * (nodes.replicas + 1), resources.config.slab_bytes)
        self._complete: list[int] = []
        """The steps known complete for every rank (saved, or restored), oldest first."""
        self._drain: asyncio.Task[None] | None = None
        self._drain_failed = False
        self._due: int | None = None
        """The newest complete step whose drain was skipped while another ran: drained next
        (rank 0's decides, for every rank)."""
        self._own: set[str] | None = None
        """The names of this rank's own shards in its node's tier: listed once, at the first
        save (an earlier life's are replaced by a save of their step), then kept up to
        date."""
        self._draining: int | None = None
        """The step the drain in flight reads (never pruned meanwhile)."""

    @property
    def holders(self) -> list[int]:
        return self.nodes.holders(self.nodes.rank)

    @property
    def sources(self) -> list[int]:
        return self.nodes.sources(self.nodes.rank)

    def shard_path(self, step: int) -> str:
        """This rank's shard of `step` in its node's local tier."""
        return join(self.local_root, shard_name(step, self.nodes.rank, self.nodes.world_size))

    async def start(self) -> None:
        """Check, on every rank at once, that each node's local tier takes a save (made, and
        written to: a read-only or missing disk is found now, not at the first save).

        Raises:
            StorageError: this rank's local tier cannot be written (naming it); `PeerError`
                naming the rank whose cannot, on the others.
        """
        probe = self.local.area_of(join(self.local_root, _PROBE))
        error: Exception | None = None
        try:
            await self.local.start_save(probe)
            await self.local.discard(probe)
        except Exception as failure:  # every rank must reach the all-gather
            error = failure
        found = await self._agree.all_gather_object(None if error is None else describe(error))
        if error is not None:
            raise StorageError(f"Tiers.local {self.local_root}: expected a directory this node "
                               f"can write its checkpoints in, found {describe(error)}; "
                               "checked when the engine starts", path=self.local_root,
                               errno=getattr(error, "errno", None)) from error
        failed = next((rank for rank, what in enumerate(found) if what is not None), None)
        if failed is not None:
            raise PeerError(f"rank {failed}'s local tier cannot be written: {found[failed]}",
                            rank=failed)

    # -- save -----------------------------------------------------------------------------

    async def save(self, state_dict: Mapping[str, Any], step: int, *, options: SaveOptions,
                   ready: Mapping[torch.device, torch.cuda.Event],
                   on_staged: Callable[[], None]) -> SaveResult:
        """Save this rank's shard of `step` to the tiers (collective: every rank saves the
        same step).

        Raises:
            this rank's own error (its shard not committed), or PeerError naming the rank
            whose shard or replica failed; the step is then not complete (nothing older is
            pruned), and a restore uses an older one.

        Cancellation: this rank's work stops, but its streams are ended and it takes part
        in the agreement (reporting itself failed), then the cancellation is raised.
        """
        self._seq += 1
        jobs: list[SaveJob] = []

        def abort_jobs() -> None:
            for job in jobs:
                job.abort()

        return await to_its_end(self._save(state_dict, step, self._seq, options, ready,
                                           on_staged, jobs), on_cancel=abort_jobs)

    async def _save(self, state_dict: Mapping[str, Any], step: int, seq: int,
                    options: SaveOptions, ready: Mapping[torch.device, torch.cuda.Event],
                    on_staged: Callable[[], None], jobs: list[SaveJob]) -> SaveResult:
        nodes = self.nodes
        tag = seq % _TAGS
        path = self.shard_path(step)
        placement = NodePlacement(nodes, num_bins=options.num_bins,
                                  slab_bytes=options.slab_bytes)
        sender = None
        if self.holders:
            assert self._channel is not None
            sender = ShardSender(self._channel, self.holders, tag=tag, step=step,
                                 rank=nodes.rank, world_size=nodes.world_size,
                                 turn=self._send_turns.take(seq),
                                 sends=placement.is_replicated)
        receiving = [asyncio.ensure_future(self._receive(src, tag, seq))
                     for src in self.sources]
        result: SaveResult | None = None
        job: SaveJob | None = None
        error: BaseException | None = None
        try:
            await self._replace_earlier(step)
            job = SaveJob(state_dict, path, seq=seq, options=options, ready=ready,
                          storage=self.local, resources=self._resources,
                          coordinator=self._shards, plan_cache=self._plan_cache,
                          on_staged=on_staged, file_rank=nodes.rank,
                          consumers=[] if sender is None else [sender], placement=placement)
            jobs.append(job)
            result = await job.run()
        except (Exception, asyncio.CancelledError) as failure:  # reported, then raised
            error = failure
        if sender is not None:
            replica = None
            if result is not None and job is not None:
                try:
                    replica = await self._resources.run_blocking(
                        _replica_manifest, job.published[MANIFEST_NAME], path,
                        placement.is_replicated)
                except Exception as failure:  # its holders then discard what they received
                    logger.warning("rank %d: step %d: the replica's manifest could not be "
                                   "made: %s", nodes.rank, step, describe(failure))
            await self._end_stream(sender, replica)
        received = await asyncio.gather(*receiving, return_exceptions=True)
        kept = [src for src, got in zip(self.sources, received, strict=True)
                if isinstance(got, ShardReceived)]
        for src, got in zip(self.sources, received, strict=True):
            if isinstance(got, BaseException):
                logger.warning("rank %d: step %d: the replica of rank %d's shard was not kept "
                               "here: %s", nodes.rank, step, src, got)
        async with self._turns.take(seq):
            reports = await self._agree.all_gather_object({
                "ok": result is not None, "error": None if error is None else describe(error),
                "kept": kept, "draining": self._drain is not None and not self._drain.done()})
        await self._after(step, reports)
        if error is not None:
            raise error
        assert result is not None
        culprit = _culprit(reports, nodes)
        if culprit is not None:
            rank, what = culprit
            raise PeerError(f"step {step}: expected every rank's shard and replicas committed, "
                            f"found rank {rank} {what}; the step is not complete (a restore "
                            "uses an older one)", rank=rank)
        return dataclasses.replace(result, step=step)

    async def _replace_earlier(self, step: int) -> None:
        """Remove this rank's shard of `step` if an earlier life left one (the first save
        lists the tier once; later ones know what they wrote). A failure is logged: the save
        then fails at its start, with every other rank."""
        try:
            if self._own is None:
                names = await self.local.list_checkpoints(self.local_root)
                self._own = {name for name in names if (shard := parse_shard(name)) is not None
                             and shard[1:] == (self.nodes.rank, self.nodes.world_size)}
            name = shard_name(step, self.nodes.rank, self.nodes.world_size)
            if name in self._own:
                await self.local.remove_checkpoint(self.shard_path(step))
            self._own.add(name)
        except Exception as error:
            logger.warning("rank %d: step %d: an earlier life's shard could not be removed: "
                           "%s", self.nodes.rank, step, describe(error))

    async def _receive(self, src: int, tag: int, seq: int) -> ShardReceived | None:
        assert self._channel is not None
        async with self._receive_turns[src].take(seq):
            return await receive_shard(self._channel, src, tag=tag, storage=self.local,
                                       root=self.local_root, buffers=self._buffers)

    async def _end_stream(self, sender: ShardSender, manifest: bytes | None) -> None:
        """End the replicas' streams: committed (with the shard's manifest) or not."""
        try:
            await sender.end(manifest)
        except PeerError as error:  # a holder gone: it reports itself at the agreement
            logger.warning("rank %d: a replica stream to %s broke: %s", self.nodes.rank,
                           sorted(sender.failed), error)

    async def _after(self, step: int, reports: list[dict[str, Any]]) -> None:
        """Once every rank reported: prune and drain if the step is complete (on every rank
        alike: the decisions are made from the same reports)."""
        if _culprit(reports, self.nodes) is not None:
            return
        self._complete = sorted({*self._complete, step})
        await self._prune()
        if self.store_root is None or not (step % self.tiers.store_every == 0
                                           or self._drain_failed):
            return
        if any(report["draining"] for report in reports):
            logger.info("rank %d: drain of step %d to %s deferred: an earlier drain is still "
                        "running; the newest complete step is drained once it ends",
                        self.nodes.rank, step, self.store_root)
            self._due = step
            return
        self._drain = asyncio.ensure_future(self._run_drains(step))

    async def _run_drains(self, step: int | None) -> None:
        """Drain `step` in the background, then, while steps were deferred meanwhile, the
        newest of them (rank 0 says which, on the drains' collectives, so every rank drains
        the same). A failure is logged (every rank learns it), and the next complete step is
        drained instead; a rank gone from the drains' group ends the drains (logged)."""
        assert self.store is not None and self.store_root is not None
        while step is not None:
            self._draining = step
            try:
                committed = await drain_step(step, shard=self.shard_path(step),
                                             collectives=self._drains, local=self.local,
                                             local_files=self.local_files,
                                             store=self.store, store_root=self.store_root,
                                             resources=self._resources,
                                             retention=self._store_retention)
                self._drain_failed = False
                logger.info("rank %d: step %d drained to %s%s", self.nodes.rank, step,
                            self.store_root,
                            f"; pruned {list(committed.pruned)}" if committed.pruned else "")
            except Exception as error:
                self._drain_failed = True
                logger.warning("rank %d: drain of step %d to %s failed (the next complete step "
                               "is drained instead): %s", self.nodes.rank, step,
                               self.store_root, describe(error))
            finally:
                self._draining = None
            due = self._due if self._due is not None and self._due > step else None
            try:
                step = await self._drains.broadcast_object(due, src=0)
            except PeerError as error:  # a rank is gone: no drain can complete any more
                logger.warning("rank %d: drains to %s stopped: %s", self.nodes.rank,
                               self.store_root, describe(error))
                return
            if step is not None and self._due is not None and self._due <= step:
                self._due = None

    async def _prune(self) -> None:
        """On a node's first rank: remove every shard in the node's tier (its ranks' own, the
        replicas they keep, and an earlier life's or world's) of a step older than the
        `keep_local` newest complete ones; never the step being drained."""
        nodes = self.nodes
        if len(self._complete) < self.tiers.keep_local or nodes.rank % nodes.ranks_per_node:
            return
        cutoff = self._complete[-self.tiers.keep_local]
        self._complete = self._complete[-self.tiers.keep_local:]
        try:
            names = await self.local.list_checkpoints(self.local_root)
            doomed = [name for name in names if (shard := parse_shard(name)) is not None
                      and shard[0] < cutoff and shard[0] != self._draining]
            await asyncio.gather(*(self.local.remove_checkpoint(join(self.local_root, name))
                                   for name in doomed))
        except Exception as error:
            logger.warning("node %d: pruning %s failed (tried again after the next complete "
                           "step): %s", nodes.node, self.local_root, describe(error))

    # -- restore ---------------------------------------------------------------------------

    async def restore(self, state_dict: Mapping[str, Any], *,
                      step: int | None) -> RestoreResult:
        """See `Engine.restore`."""
        context = RestoreContext(
            nodes=self.nodes, local=self.local, local_root=self.local_root, store=self.store,
            store_root=self.store_root, agree=self._agree, channel=self._channel,
            loads=self._loads, buffers=self._buffers,
            share_store_reads=self._share_store_reads)
        result = await restore(state_dict, context, step=step)
        self._complete = [] if result.step is None else [result.step]
        self._own = None  # listed again at the next save
        return result

    async def aclose(self) -> None:
        """Wait for the drain in flight, and drain the step deferred behind it if the drain
        ended before it looked (every rank alike: `_due` is decided from the same reports and
        broadcasts); let the replica channel's threads go."""
        try:
            if self._drain is not None:
                await uncancellable(self._drain)
                if self._due is not None:
                    self._drain = asyncio.ensure_future(self._run_drains(self._due))
                    await uncancellable(self._drain)
        finally:
            if self._channel is not None:
                self._channel.close()


def _culprit(reports: list[dict[str, Any]], nodes: Nodes) -> tuple[int, str] | None:
    """The first rank whose shard, or a replica it should keep, is not committed (and what
    failed), or None when the step is complete."""
    for rank, report in enumerate(reports):
        if not report["ok"]:
            return rank, f"failing: {report['error']}"
    for rank in range(nodes.world_size):
        for holder in nodes.holders(rank):
            if rank not in reports[holder]["kept"]:
                return holder, f"not keeping rank {rank}'s replica"
    return None


def _replica_manifest(manifest: bytes, path: str, replicated: Callable[[str], bool]) -> bytes:
    """Blocks (CPU): the manifest of a shard's replica (its files that go to the replicas)."""
    parsed = parse_manifest(manifest, join(path, MANIFEST_NAME))
    return part_of(parsed, [name for name in parsed.files if replicated(name)], stored=False)
