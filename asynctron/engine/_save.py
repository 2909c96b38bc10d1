"""One save, from state dict to committed checkpoint, on this rank: the pipeline behind
`Engine.save`.

Phases:
1. plan: `flatten` turns the state dict into items (on the executor: a state dict of 100k
   tensors never stalls the loop); `Coordinator.start` has the coordinator make the save's
   area and all ranks agree whether the plan of this global structure is cached; then this
   rank's request is built from the cached file plan, or planned afresh (`_save_plan`, with
   the plan exchange across ranks);
2. stage+write (`_pipeline`): slabs filled wave by wave, one writer per bin file, fsynced;
3. finish: `Coordinator.finish` has the coordinator commit the manifest of every rank's items
   (fsyncs, rename, `latest` never moved backwards, pruning) only if every rank succeeded.
A failure or cancellation anywhere, on any rank, discards the area and commits nothing; the
previous checkpoint is untouched.

Cancellation has one owner, the job's `Abort`: it stops this rank's own work (phases 1-2) at
once, while the protocol's collectives always run to their end and carry the failure to the
other ranks.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem

from asynctron._concurrency import to_its_end
from asynctron.engine._coordinator import Coordinator, Start, describe
from asynctron.engine._pipeline import BatchConsumer, stage_and_write
from asynctron.engine._plan_cache import FilePlan, PlanCache
from asynctron.engine._report import WriteReport
from asynctron.engine._resources import SaveResources
from asynctron.engine._save_plan import (
    SaveRequest,
    build_request,
    dcp_items,
    file_plan,
    plain_items,
    structure_digest,
)
from asynctron.engine._task import SaveResult
from asynctron.storage import Committed, store_operation
from asynctron.storage.backends import SaveStorage, StoreOperation
from asynctron.storage.format import (
    MANIFEST_NAME,
    FlatStateDict,
    PlainPlan,
    PlannedItem,
    SavePlan,
    ShardInfo,
    encode_manifest,
    flatten,
    is_plain,
    item_paths,
    merge_structures,
    metadata_bytes,
    plan_final,
    plan_global,
    plan_local,
    plan_plain_global,
)
from asynctron.storage.format import METADATA_NAME as DCP_METADATA_NAME
from asynctron.storage.format import digest as digest_of

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveOptions:
    """How one save runs: the engine's settings at the time of the request."""

    num_bins: int
    snapshot: bool
    slab_bytes: int
    direct_io: bool
    checksum: str | None
    format: Literal["asynctron", "dcp"]


class Abort:
    """The cancellation of one save on this rank. `request()` stops the rank's own work (its
    planning, staging and writing) at once where it waits, else at its next step; the
    protocol's collectives are never cut short (the other ranks wait in them).

    Work runs in a cancel scope (an `asyncio.timeout` whose deadline an abort moves to now),
    not in a task of its own: no extra loop turn per step of the save.
    """

    def __init__(self) -> None:
        self.requested = False
        self._scope: asyncio.Timeout | None = None

    def request(self) -> None:
        self.requested = True
        if self._scope is not None:
            self._scope.reschedule(asyncio.get_running_loop().time())

    async def run(self, work: Awaitable[T]) -> T:
        """Await this rank's own `work`; raise `CancelledError` once an abort is requested."""
        if self.requested:
            if asyncio.iscoroutine(work):
                work.close()
            raise asyncio.CancelledError
        scope = asyncio.timeout(None)
        self._scope = scope
        try:
            async with scope:
                return await work
        except TimeoutError:
            if scope.expired():
                raise asyncio.CancelledError from None
            raise
        finally:
            self._scope = None


class Placement(Protocol):
    """Who writes which item, decided across ranks in place of the job-wide deduplication
    (a tier's saves: an item once per node, sorted into groups of files); every method
    blocks (CPU) and runs on the executor."""

    def signature(self, flat: FlatStateDict) -> str | None:
        """What this rank's plan depends on, as text (None: plan afresh every time)."""
        ...

    def local_plan(self, flat: FlatStateDict) -> Any:
        """This rank's items, as the coordinator's `assign` takes them."""
        ...

    def assign(self, plans: list[Any]) -> tuple[list[Any], None]:
        """On the coordinator: each rank's share, from every rank's `local_plan`.

        Raises:
            ValueError: the ranks' items cannot be placed (naming the key).
        """
        ...

    def items(self, flat: FlatStateDict, plan: Any, share: Any) -> list[PlannedItem]:
        """The items this rank writes (each in its group), from its plan and share."""
        ...

    def shard(self, files: Sequence[str]) -> ShardInfo:
        """What the manifest of this rank's save, of `files`, says of its shard."""
        ...


@dataclass(slots=True)
class _Planned:
    """Phase 1's outcome on this rank: the request (and DCP's metadata, on the coordinator of
    a fresh plan), or the error that stopped it."""

    start: Start | None = None
    request: SaveRequest | None = None
    metadata: Metadata | None = None
    error: BaseException | None = None


class SaveJob:
    """Runs one save to commit. Not constructed directly; `Engine.save` makes one."""

    def __init__(self, state_dict: Mapping[str, Any], path: str, *, seq: int,
                 options: SaveOptions, ready: Mapping[torch.device, torch.cuda.Event],
                 storage: SaveStorage, resources: SaveResources, coordinator: Coordinator,
                 plan_cache: PlanCache, on_staged: Callable[[], None],
                 file_rank: int | None = None, consumers: Sequence[BatchConsumer] = (),
                 placement: Placement | None = None) -> None:
        self.path = path
        self.seq = seq
        self._file_rank = coordinator.rank if file_rank is None else file_rank
        """The rank in this save's file names (`__<rank>_<bin>.distcp`): the coordination
        group's, or a tier shard's global rank (saved by a solo coordinator)."""
        self._consumers = consumers
        self._placement = placement
        """Who writes which item (a tier's save), or None: each once per job."""
        self._state_dict = state_dict
        self._options = options
        self._ready = ready
        self._storage = storage
        self._resources = resources
        self._run_blocking = resources.run_blocking
        self._coordinator = coordinator
        self._plan_cache = plan_cache
        self._on_staged = on_staged
        self._abort = Abort()
        self.published: Mapping[str, bytes] = {}
        """On the coordinator, once committed: the files it published (the manifest)."""
        self._t_request = time.perf_counter()
        self._requested_unix_s = time.time()
        self._t_staged: float | None = None
        self._store = StoreOperation("save")
        """The save's requests to an object store: one clock, and what they cost."""

    def abort(self) -> None:
        """Stop this rank's own work (planning, staging, writing) at once; `run` then raises
        CancelledError, having taken part in the protocol's collectives."""
        self._abort.request()

    def _mark_staged(self) -> None:
        self._t_staged = time.perf_counter()
        self._on_staged()

    async def run(self) -> SaveResult:
        """Plan, stage, write and finish across ranks. Raises one error (ExceptionGroups
        unwrapped, kept as `__context__`): this rank's own, or `PeerError` naming the rank that
        failed; whatever happens, nothing is committed unless every rank succeeded.

        Cancellation: this rank's work stops, but the save still takes part in the protocol's
        collectives, reporting itself failed (the other ranks wait for them), then the
        cancellation is raised; the area is discarded and nothing commits. A cancellation
        that arrives once every rank has written may find the checkpoint committed.

        On an object store the save is one `store_operation`: it fails once the store has
        answered none of its requests for the backend's deadline, however many it sends.
        """
        with store_operation("save", self.path) as self._store:
            return await to_its_end(self._protocol(), on_cancel=self._abort.request)

    async def _protocol(self) -> SaveResult:
        planned = await self._plan_phase()
        t_planned = time.perf_counter()
        assert planned.start is not None
        report = await self._write_phase(planned)
        t_written = time.perf_counter()
        committed = await self._finish_phase(planned, report)
        request = planned.request
        assert request is not None
        t_done = time.perf_counter()
        return SaveResult(
            path=self.path,
            nbytes=request.nbytes,
            files=tuple(bin.layout.file_name for bin in request.bins),
            num_items=len(request.plan.records),
            plan_s=t_planned - self._t_request,
            stage_s=(self._t_staged or t_done) - self._t_request,
            write_s=t_written - self._t_request,
            commit_s=t_done - t_written,
            total_s=t_done - self._t_request,
            pruned=committed.pruned,
            warnings=committed.warnings,
            store=self._store.statistics(),
        )

    # phase 1 ------------------------------------------------------------------------------

    async def _plan_phase(self) -> _Planned:
        """Flatten, start across ranks, and plan. Errors of this rank's own work are kept in
        the outcome (the other ranks learn of them at finish); a failed start raises."""
        planned = _Planned()
        flat: FlatStateDict | BaseException
        digest: str | None = None
        try:
            flat, digest = await self._abort.run(self._run_blocking(self._flatten))
        except (Exception, asyncio.CancelledError) as error:
            flat = error
        coordinator, seq = self._coordinator, self.seq
        try:
            async with coordinator.planning_turn(seq):
                held = self._plan_cache.snapshot()  # the plans announced are the plans used
                plain = (not isinstance(flat, BaseException) and self._options.format != "dcp"
                         and is_plain(flat))
                planned.start = await coordinator.start(self._storage, self.path, digest,
                                                        list(held), plain=plain)
                try:
                    planned.request, planned.metadata = await self._plan(flat, planned.start,
                                                                         held)
                except (Exception, asyncio.CancelledError) as error:  # reported at finish
                    planned.error = error
        except BaseException:
            await coordinator.skip_finishing(seq)  # the start failed on every rank
            raise
        return planned

    def _flatten(self) -> tuple[FlatStateDict, str | None]:
        """Blocks: the state dict's items, and the digest of what its file plan depends on
        (None in DCP's format, whose pickled values change size: planned afresh each time).
        One executor call: each is a GIL hand-off that a busy trainer makes cost up to 5 ms."""
        options = self._options
        flat = flatten(self._state_dict, values_as_items=options.format == "dcp")
        if options.format == "dcp":
            return flat, None
        if self._placement is not None:
            signature = self._placement.signature(flat)
            return flat, None if signature is None else digest_of(
                memoryview(signature.encode()))
        return flat, structure_digest(flat, num_bins=options.num_bins,
                                      rank=self._file_rank, slab_bytes=options.slab_bytes)

    async def _plan(self, flat: FlatStateDict | BaseException, start: Start,
                    held: Mapping[Hashable, FilePlan]) -> tuple[SaveRequest, Metadata | None]:
        """This rank's request: from the cached file plan when every rank holds it, else
        planned through the plan exchange (which a rank whose state dict could not be
        flattened joins with its error): without DCP's planner when every rank's items are
        plain, else with it (DTensor shards, pickled values, DCP's metadata)."""
        options, abort = self._options, self._abort
        cached = held[start.plan_key] if start.cached else None
        self._plan_cache.record_use(start.plan_key, hit=cached is not None)
        if cached is not None:
            assert not isinstance(flat, BaseException)
            return await abort.run(self._run_blocking(_request, flat, cached, None,
                                                      options)), None
        if self._placement is not None:
            return await self._placed(flat, start), None
        local: Any
        if isinstance(flat, BaseException):
            local = flat
        else:
            try:
                local = await abort.run(self._run_blocking(
                    PlainPlan.of if start.plain else functools.partial(
                        plan_local, is_coordinator=self._coordinator.is_coordinator), flat))
            except (Exception, asyncio.CancelledError) as error:
                local = error
        if start.plain:
            mine, metadata = await self._coordinator.exchange_plans(local, _plain_global)
            assert not isinstance(flat, BaseException)
            items = await abort.run(self._run_blocking(plain_items, flat, local, mine))
            return await self._planned(flat, start, items, None), metadata
        planner, local_plan = (None, local) if isinstance(local, BaseException) else local
        share, metadata = await self._coordinator.exchange_plans(
            local_plan, None if planner is None else functools.partial(plan_global, planner))
        assert planner is not None and not isinstance(flat, BaseException)
        save_plan = await abort.run(self._run_blocking(plan_final, flat, planner, share,
                                                       metadata))
        return await self._planned(flat, start, dcp_items(save_plan), save_plan), metadata

    async def _placed(self, flat: FlatStateDict | BaseException, start: Start) -> SaveRequest:
        """This rank's request, its items placed by the placement across ranks."""
        placement, abort = self._placement, self._abort
        assert placement is not None
        local: Any = flat
        if not isinstance(flat, BaseException):
            try:
                local = await abort.run(self._run_blocking(placement.local_plan, flat))
            except (Exception, asyncio.CancelledError) as error:
                local = error
        share, _ = await self._coordinator.exchange_plans(local, placement.assign)
        assert not isinstance(flat, BaseException)
        items = await abort.run(self._run_blocking(placement.items, flat, local, share))
        return await self._planned(flat, start, items, None)

    async def _planned(self, flat: FlatStateDict, start: Start, items: list[PlannedItem],
                       save_plan: SavePlan | None) -> SaveRequest:
        """The file plan of this rank's items (kept in the cache), and the request."""
        options = self._options
        plan, sources = await self._abort.run(self._run_blocking(functools.partial(
            file_plan, flat, items, num_bins=options.num_bins, rank=self._file_rank,
            slab_bytes=options.slab_bytes, torch_save_frames=options.format == "dcp")))
        if start.plan_key is not None:
            self._plan_cache.store(start.plan_key, plan)
        dcp = None if save_plan is None else (save_plan, [save_plan.items[source]
                                                          for source in sources])
        return await self._abort.run(self._run_blocking(_request, flat, plan, dcp,
                                                        options))

    # phase 2 ------------------------------------------------------------------------------

    async def _write_phase(self, planned: _Planned) -> WriteReport:
        """Stage and write this rank's bins (unless phase 1 failed); this rank's report."""
        options, rank, request = self._options, self._file_rank, planned.request
        if planned.error is None:
            assert request is not None and planned.start is not None
            try:
                await self._abort.run(stage_and_write(
                    request, self._storage, planned.start.area, self._resources,
                    snapshot=options.snapshot, direct_io=options.direct_io, ready=self._ready,
                    on_staged=self._mark_staged, consumers=self._consumers))
                return await self._abort.run(self._run_blocking(request.report, rank))
            except BaseException as error:  # reported to the others, then raised at finish
                planned.error = error
        return WriteReport(rank=rank, error=describe(planned.error))

    # phase 3 ------------------------------------------------------------------------------

    async def _finish_phase(self, planned: _Planned, report: WriteReport) -> Committed:
        """Every rank's reports to the coordinator, which commits if all succeeded; raise this
        rank's own error, else the protocol's."""
        assert planned.start is not None
        async with self._coordinator.finishing_turn(self.seq):
            try:
                committed = await self._coordinator.finish(
                    report, storage=self._storage, area=planned.start.area, seq=self.seq,
                    publish=self._publish, metadata=planned.metadata)
            except BaseException:
                if planned.error is None:
                    raise
        if planned.error is not None:
            raise planned.error
        return committed

    def _publish(self, reports: Sequence[WriteReport], metadata: Metadata | None
                 ) -> dict[str, bytes]:
        """Blocks (on the coordinator): the manifest of every rank's items; in DCP's format
        also DCP's `.metadata`, so stock `torch.distributed.checkpoint.load` reads it."""
        files: dict[str, int] = {}
        for report in reports:
            files.update(report.files)
        structure = merge_structures([r.structure for r in reports if r.structure is not None])
        records = tuple(item for r in reports for item in r.records)
        checksums = None
        if self._options.checksum is not None:
            checksums = tuple(digest for r in reports for digest in r.checksums or ())
        published = {MANIFEST_NAME: encode_manifest(
            structure=structure, items=records, checksums=checksums, files=files,
            created_unix_s=self._requested_unix_s, checksum=self._options.checksum,
            shard=None if self._placement is None else self._placement.shard(list(files)))}
        if self._options.format == "dcp":
            published[DCP_METADATA_NAME] = metadata_bytes(
                records, [frame for r in reports for frame in r.frames],
                item_paths(json.loads(structure)), self.path)
        self.published = published
        return published


def _request(flat: FlatStateDict, plan: FilePlan,
             dcp: tuple[SavePlan, Sequence[WriteItem]] | None,
             options: SaveOptions) -> SaveRequest:
    return build_request(flat, plan, dcp, checksum=options.checksum is not None)


def _plain_global(plans: list[PlainPlan]) -> tuple[list[list[bool]], None]:
    return plan_plain_global(plans), None
