"""The save protocol across ranks (seed 002: plan → write → finalize), awaited on the loop.

Every rank plans locally and writes its own files; the coordinator (rank 0 of the group)
creates the tmp dir, makes the global plan, and commits only if every rank succeeded; then
every rank learns the outcome. Collectives per save, in this order on every rank:
1. `start`: all-gather of each rank's structure digest and the plan keys it has cached; the
   coordinator's entry also carries the tmp dir it created, or why it could not;
2. `exchange_plans`, skipped when every rank holds the file plan of this global structure
   (seed 002's plan cache): gather the local plans at the coordinator, which deduplicates them
   (DCP's `create_global_plan`, or for plain items `plan_plain_global`), then scatter each
   rank its final plan;
3. `finish`: gather every rank's write report (its items with checksums, files and structure;
   or its error) at the coordinator, which commits only if all succeeded; broadcast the outcome.
A failure on any rank travels through these collectives, so every rank calls the same ones in
the same order and nobody waits for a rank that gave up. Steps 1-2 run on one gloo group and
step 3 on another, and on each group saves take turns in request order: with several saves in
flight, save N+1 plans while save N finishes, yet no two ranks ever pair different collectives.
A rank that dies makes the others' next collective raise `PeerError` (gloo sees the closed
connection, or the group's timeout expires): nobody commits, nobody hangs. On one process the
same steps run on `SoloCollectives`, without communication.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from asynctron._concurrency import RunBlocking
from asynctron.engine._collectives import Collectives
from asynctron.engine._report import WriteReport
from asynctron.engine._turns import Turns
from asynctron.errors import PeerError
from asynctron.storage import Committed, SaveArea
from asynctron.storage.backends import Committer, SaveStorage
from asynctron.storage.format import digest


@dataclass(frozen=True, slots=True)
class Start:
    """What every rank knows once a save has started."""

    area: SaveArea
    """Where every rank writes its files (made by the coordinator)."""
    plan_key: Hashable | None
    """The global structure (every rank's digest, hashed); None when it cannot be cached."""
    cached: bool
    """Every rank holds the file plan for `plan_key`: no plan collectives this time."""
    plain: bool
    """Every rank's items are plain (no DTensor, no pickled value): planned without DCP's
    planner."""


@dataclass(frozen=True, slots=True)
class _Failure:
    """A rank's failure, as sent through a collective."""

    rank: int
    what: str


Publish = Callable[[Sequence[WriteReport], Metadata | None], Any]
"""Turns every rank's report (and DCP's global metadata) into the files the coordinator
commits: `{name: bytes}` (`manifest.json`, or DCP's `.metadata`)."""


class Coordinator:
    """Runs the protocol for one engine: `start` and `exchange_plans` on the `planning`
    collectives, `finish` on the `finishing` ones (two groups, so that a save can plan while
    an earlier one finishes); on each, saves take turns in request order.

    Not constructed directly; the engine makes one.
    """

    def __init__(self, planning: Collectives, finishing: Collectives, run_blocking: RunBlocking,
                 committer: Committer) -> None:
        self.planning = planning
        self.finishing = finishing
        self._run_blocking = run_blocking
        self._committer = committer
        self._planning_turns = Turns()
        self._finishing_turns = Turns()

    @property
    def rank(self) -> int:
        return self.planning.rank

    @property
    def world_size(self) -> int:
        return self.planning.world_size

    @property
    def is_coordinator(self) -> bool:
        return self.planning.rank == 0

    @property
    def num_calls(self) -> int:
        """Collectives the protocol has issued so far (0 on one process)."""
        return self.planning.num_calls + self.finishing.num_calls

    def planning_turn(self, seq: int) -> contextlib.AbstractAsyncContextManager[None]:
        """Save `seq`'s turn at `start` and `exchange_plans`."""
        return self._planning_turns.take(seq)

    def finishing_turn(self, seq: int) -> contextlib.AbstractAsyncContextManager[None]:
        """Save `seq`'s turn at `finish`."""
        return self._finishing_turns.take(seq)

    async def skip_finishing(self, seq: int) -> None:
        """Save `seq` never reached `finish` (its start failed, on every rank)."""
        await self._finishing_turns.skip(seq)

    async def start(self, storage: SaveStorage, path: str, digest: str | None,
                    cached_keys: Sequence[Hashable], *, plain: bool) -> Start:
        """Make the save's area (coordinator), agree on the plan key and on whether every
        rank's items are plain.

        Raises:
            FileExistsError: the target exists (on every rank).
            StorageError: the coordinator could not make the area (there); `PeerError`
                naming rank 0 elsewhere.
        """
        entry: dict[str, Any] = {"digest": digest, "cached": list(cached_keys), "plain": plain}
        coordinator_error: Exception | None = None
        if self.is_coordinator:
            area = storage.area_of(path)
            try:
                await storage.start_save(area)
                entry["area"] = area
            except Exception as error:  # every rank must reach the all-gather
                coordinator_error = error
                entry["error"] = (type(error).__name__, str(error))
        entries = await self.planning.all_gather_object(entry)
        head = entries[0]
        if "error" in head:
            if coordinator_error is not None:
                raise coordinator_error
            kind, message = head["error"]
            if kind == "FileExistsError":
                raise FileExistsError(message)
            raise PeerError(f"checkpoint {path}: expected rank 0 to start the save, found "
                            f"{kind}: {message}; fix rank 0's storage and save again", rank=0)
        digests = [e["digest"] for e in entries]
        plan_key = None if None in digests else _global_key(digests)
        cached = plan_key is not None and all(plan_key in e["cached"] for e in entries)
        return Start(area=head["area"], plan_key=plan_key, cached=cached,
                     plain=all(e["plain"] for e in entries))

    async def exchange_plans(self, local: Any, global_step: Callable[[list[Any]], tuple[
            Sequence[Any], Metadata | None]] | None) -> tuple[Any, Metadata | None]:
        """Give the coordinator this rank's local plan (or its planning error); get back this
        rank's final share (and, on the coordinator, DCP's global metadata). On the
        coordinator, `global_step(every rank's plan)` makes the shares (on the executor).

        Raises:
            PeerError: another rank failed to plan, or the coordinator's global step failed
                (the rank that failed raises its own error).
        """
        sent = _Failure(self.rank, describe(local)) if isinstance(local, BaseException) else local
        gathered = await self.planning.gather_object(sent, dst=0)
        shares: list[Any] | None = None
        metadata: Metadata | None = None
        coordinator_error: Exception | None = None
        if self.is_coordinator:
            assert gathered is not None
            failures = [p for p in gathered if isinstance(p, _Failure)]
            if failures:
                shares = [failures[0]] * len(gathered)
            else:
                assert global_step is not None
                try:
                    plans, metadata = await self._run_blocking(global_step, gathered)
                    shares = list(plans)
                except Exception as error:  # e.g. one key holding different tensors on ranks
                    coordinator_error = error
                    shares = [_Failure(0, describe(error))] * len(gathered)
        share = await self.planning.scatter_object(shares, src=0)
        if isinstance(local, BaseException):
            raise local
        if coordinator_error is not None:
            raise coordinator_error
        if isinstance(share, _Failure):
            raise PeerError(f"save plan: expected every rank to plan, found rank {share.rank} "
                            f"failing: {share.what}; fix it and save again", rank=share.rank)
        return share, metadata

    async def finish(self, report: WriteReport, *, storage: SaveStorage, area: SaveArea, seq: int,
                     publish: Publish, metadata: Metadata | None) -> Committed:
        """Gather every rank's report; the coordinator commits if all succeeded; every rank
        learns the outcome; then the coordinator discards the area of a save that did not
        commit (whatever failed, even a collective), so no rank waits for that clean-up.

        Returns:
            what was pruned after the commit, and the problems that did not undo it (moving
            `latest`, pruning), also logged on the coordinator.

        Raises:
            PeerError: another rank failed, or the coordinator could not commit.
            StorageError, FileExistsError: this rank (the coordinator) could not commit.

        Cancellation: the collectives run to their end first (a rank cannot leave them half
        done), then the cancellation is raised.
        """
        outcome = _Outcome(None, Committed())
        commit_error: Exception | None = None
        committed_here = False
        try:
            reports = await self.finishing.gather_object(report, dst=0)
            if self.is_coordinator:
                assert reports is not None
                failed = [r for r in reports if r.error is not None]
                if failed:
                    outcome = _Outcome(_Failure(failed[0].rank, failed[0].error or ""),
                                       Committed())
                else:
                    try:
                        committed = await self._committer.commit(
                            storage, area, functools.partial(publish, reports, metadata), seq)
                        outcome = _Outcome(None, committed)
                        committed_here = True
                    except Exception as error:  # every rank must reach the broadcast
                        commit_error = error
                        outcome = _Outcome(_Failure(0, describe(error)), Committed())
            outcome = await self.finishing.broadcast_object(outcome, src=0)
        finally:  # after the broadcast: no rank waits for the clean-up
            if self.is_coordinator and not committed_here:
                await storage.discard(area)
        if commit_error is not None:
            raise commit_error
        failure = outcome.failure
        if failure is not None and failure.rank != self.rank:
            raise PeerError(f"checkpoint {area.final_path}: expected every rank to write its "
                            f"share, found rank {failure.rank} failing: {failure.what}; "
                            "nothing was committed", rank=failure.rank)
        return outcome.committed


class ShardCoordinator(Coordinator):
    """Runs the protocol for saves whose every rank commits a shard of its own (a tier's):
    `start` makes this rank's area and `finish` commits it, alone; between them the plan is
    made with every other rank's, as for a checkpoint of the whole job (`exchange_plans`, on
    the `planning` collectives). What a shard holds is decided there, so a rank commits its
    shard whatever the others' fate: whether the step is whole is its caller's to agree on.
    """

    async def start(self, storage: SaveStorage, path: str, digest: str | None,
                    cached_keys: Sequence[Hashable], *, plain: bool) -> Start:
        """Make this rank's area, and agree with every rank on the plan key (`Start.area` is
        this rank's own).

        Raises:
            FileExistsError, StorageError: this rank could not make its area; `PeerError`
                naming the rank that could not, on the others (their areas discarded).
        """
        area = storage.area_of(path)
        own_error: Exception | None = None
        try:
            await storage.start_save(area)
        except Exception as error:  # every rank must reach the all-gather
            own_error = error
        entries = await self.planning.all_gather_object({
            "digest": digest, "cached": list(cached_keys), "plain": plain,
            "error": None if own_error is None else describe(own_error)})
        if own_error is not None:
            raise own_error
        failed = next((rank for rank, entry in enumerate(entries) if entry["error"]), None)
        if failed is not None:
            await storage.discard(area)
            raise PeerError(f"shard {path}: expected every rank to start its shard, found rank "
                            f"{failed} failing: {entries[failed]['error']}", rank=failed)
        digests = [entry["digest"] for entry in entries]
        plan_key = None if None in digests else _global_key(digests)
        return Start(area=area, plan_key=plan_key,
                     cached=plan_key is not None and all(plan_key in entry["cached"]
                                                         for entry in entries),
                     plain=all(entry["plain"] for entry in entries))

    async def finish(self, report: WriteReport, *, storage: SaveStorage, area: SaveArea,
                     seq: int, publish: Publish, metadata: Metadata | None) -> Committed:
        """Commit this rank's shard if it wrote it; else discard its area (its caller raises
        its error).

        Raises:
            StorageError, FileExistsError: the commit failed (the area is discarded).
        """
        if report.error is not None:
            await storage.discard(area)
            return Committed()
        committed_here = False
        try:
            committed = await self._committer.commit(
                storage, area, functools.partial(publish, [report], metadata), seq)
            committed_here = True
            return committed
        finally:
            if not committed_here:
                await storage.discard(area)


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What the coordinator tells every rank at the end of a save."""

    failure: _Failure | None
    committed: Committed


def describe(error: BaseException | None) -> str:
    """A failure as one line for the other ranks: its type and message."""
    if isinstance(error, asyncio.CancelledError):
        return "the save was cancelled"
    return f"{type(error).__name__}: {error}"


def _global_key(digests: Sequence[str]) -> str:
    return digest(memoryview("|".join(digests).encode())) + f"/{len(digests)}"
