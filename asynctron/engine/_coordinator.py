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
import logging
import os
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.distributed.checkpoint.metadata import Metadata

from asynctron._concurrency import RunBlocking
from asynctron.errors import AsynctronError, PeerError, StorageError
from asynctron.storage import _commit, _retention, _sysio
from asynctron.storage._checksum import digest
from asynctron.storage._locks import DirLock
from asynctron.storage._manifest import ItemRecord
from asynctron.storage._retention import Retention

logger = logging.getLogger(__name__)


class Collectives(Protocol):
    """The object collectives the protocol needs: `asynctron.comm.CollectiveGroup`, or one
    process's `SoloCollectives`. Every rank calls the same ones in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_calls(self) -> int: ...

    async def all_gather_object(self, obj: Any) -> list[Any]: ...

    async def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None: ...

    async def scatter_object(self, objs: Sequence[Any] | None, *, src: int = 0) -> Any: ...

    async def broadcast_object(self, obj: Any = None, *, src: int = 0) -> Any: ...


class SoloCollectives:
    """The collectives of a world of one process: each returns at once, nothing is sent."""

    rank = 0
    world_size = 1
    num_calls = 0

    async def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    async def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj]

    async def scatter_object(self, objs: Sequence[Any] | None, *, src: int = 0) -> Any:
        assert objs is not None and len(objs) == 1
        return objs[0]

    async def broadcast_object(self, obj: Any = None, *, src: int = 0) -> Any:
        return obj


class _Turns:
    """Lets saves through one phase of the protocol one at a time, in request order (seq 1, 2,
    ...), so every rank issues that phase's collectives in the same order, however many saves
    are in flight. Every save passes each phase exactly once: `take` it or `skip` it."""

    def __init__(self) -> None:
        self._passed = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def take(self, seq: int) -> AsyncIterator[None]:
        """Wait for the saves before `seq` to pass, run the body, pass."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._passed == seq - 1)
        try:
            yield
        finally:
            await self.skip(seq)

    async def skip(self, seq: int) -> None:
        """Pass without running anything (every rank skips the same phase of the same save)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._passed >= seq - 1)
            self._passed = max(self._passed, seq)
            self._changed.notify_all()


@dataclass(frozen=True, slots=True)
class Start:
    """What every rank knows once a save has started."""

    tmp_dir: str
    """The directory every rank writes its files into (created by the coordinator)."""
    plan_key: Hashable | None
    """The global structure (every rank's digest, hashed); None when it cannot be cached."""
    cached: bool
    """Every rank holds the file plan for `plan_key`: no plan collectives this time."""
    plain: bool
    """Every rank's items are plain (no DTensor, no pickled value): planned without DCP's
    planner."""


@dataclass(frozen=True, slots=True)
class WriteReport:
    """One rank's result: its files, its items and their checksums, and its state dict's
    structure; or, when it failed, what went wrong."""

    rank: int
    records: tuple[ItemRecord, ...] = ()
    """The items' records (their checksums in `checksums`)."""
    checksums: tuple[str, ...] | None = None
    """Per record, its digest; None when saved without checksums."""
    files: dict[str, int] = field(default_factory=dict)
    structure: str | None = None
    """The structure, as JSON text."""
    error: str | None = None
    frames: tuple[tuple[int, int] | None, ...] = ()
    """Per record, in DCP's format, the lengths of the `torch.save` frame around its bytes."""


@dataclass(frozen=True, slots=True)
class _Failure:
    """A rank's failure, as sent through a collective."""

    rank: int
    what: str


Publish = Callable[[Sequence[WriteReport], Metadata | None], Any]
"""Turns every rank's report (and DCP's global metadata) into the files the coordinator
commits: `{name: bytes}` (`manifest.json`, or DCP's `.metadata`)."""


@dataclass(frozen=True, slots=True)
class Committed:
    """What followed a commit: the checkpoints pruned, and the problems that did not undo
    it (`latest` not moved, pruning failed)."""

    pruned: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


class Committer:
    """Publishes checkpoints: one commit per root at a time; `latest` only ever moves forward.
    Used on the coordinator."""

    def __init__(self, run_blocking: RunBlocking, retention: Retention | None) -> None:
        self._run_blocking = run_blocking
        self._retention = retention
        self._locks: dict[str, asyncio.Lock] = {}
        self._newest: dict[str, int] = {}

    async def commit(self, tmp_dir: str, final_path: str,
                     files: Callable[[], Mapping[str, bytes]], seq: int) -> Committed:
        """Write `files()` (the checkpoint's metadata) into `tmp_dir` and publish it as
        `final_path`: the rename is the commit. Then point `latest` at it unless a newer save
        (higher `seq`) already committed, prune this job's checkpoints beyond `keep_last`, and
        remove the debris of dead saves. All in one executor call (a loop turn is a step of an
        async trainer that holds the loop).

        Returns:
            what was pruned, and the problems after the commit (logged, not raised: the
            checkpoint is committed).

        Raises:
            FileExistsError: `final_path` exists (the tmp dir is left for the caller).
            StorageError: a write, fsync or the rename failed: nothing is committed.
        """
        root = os.path.dirname(final_path)
        lock = self._locks.setdefault(root, asyncio.Lock())
        async with lock:
            moved, committed = await self._run_blocking(
                _publish, tmp_dir, final_path, files, seq > self._newest.get(root, -1),
                self._retention, seq)
            if moved:
                self._newest[root] = seq
        for warning in committed.warnings:
            logger.warning("%s", warning)
        return committed


def _publish(tmp_dir: str, final_path: str, files: Callable[[], Mapping[str, bytes]],
             move_latest: bool, retention: Retention | None, seq: int
             ) -> tuple[bool, Committed]:
    """Blocks: under the root's exclusive lock, commit, move `latest`, prune and find the
    debris; then delete what was pruned and the debris. Returns whether `latest` moved, and
    what followed the commit."""
    warnings = []
    moved = False
    removal = _retention.Removal()
    with DirLock.take(os.path.realpath(os.path.dirname(final_path)), exclusive=True) as root:
        _commit.seal_dir(tmp_dir, files())
        if retention is not None:
            _retention.record_commit(root.path, tmp_dir, os.path.basename(final_path),
                                     retention, seq)
        _commit.publish_dir(tmp_dir, final_path)
        if move_latest:
            try:
                _commit.point_latest(final_path)
                moved = True
            except AsynctronError as error:
                warnings.append(f"checkpoint {final_path} is committed, but `latest` was not "
                                f"moved to it: {error}")
        try:
            removal = _retention.retire(root, retention)
        except AsynctronError as error:
            warnings.append(f"checkpoint {final_path} is committed, but pruning older ones "
                            f"and removing debris failed: {error}")
    warnings.extend(removal.run())
    return moved, Committed(tuple(removal.pruned), tuple(warnings))


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
        self._planning_turns = _Turns()
        self._finishing_turns = _Turns()
        self._tmp_dirs: dict[str, DirLock] = {}
        """The tmp dirs this coordinator made, locked until committed or removed."""

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

    async def start(self, path: str, digest: str | None, cached_keys: Sequence[Hashable], *,
                    plain: bool) -> Start:
        """Create the tmp dir (coordinator), agree on the plan key and on whether every rank's
        items are plain.

        Raises:
            FileExistsError: the target exists (on every rank).
            StorageError: the coordinator could not create the tmp dir (there); `PeerError`
                naming rank 0 elsewhere.
        """
        entry: dict[str, Any] = {"digest": digest, "cached": list(cached_keys), "plain": plain}
        coordinator_error: Exception | None = None
        if self.is_coordinator:
            tmp_dir = _commit.tmp_dir_for(path)
            try:
                self._tmp_dirs[tmp_dir] = await self._run_blocking(prepare_tmp_dir, path,
                                                                   tmp_dir)
                entry["tmp_dir"] = tmp_dir
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
        return Start(tmp_dir=head["tmp_dir"], plan_key=plan_key, cached=cached,
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

    async def finish(self, report: WriteReport, *, path: str, tmp_dir: str, seq: int,
                     publish: Publish, metadata: Metadata | None) -> Committed:
        """Gather every rank's report; the coordinator commits if all succeeded (else removes
        the tmp dir); every rank learns the outcome.

        Returns:
            what was pruned after the commit, and the problems that did not undo it (moving
            `latest`, pruning), also logged on the coordinator.

        Raises:
            PeerError: another rank failed, or the coordinator could not commit.
            StorageError, FileExistsError: this rank (the coordinator) could not commit.

        Cancellation: the collectives run to their end first (a rank cannot leave them half
        done), then the cancellation is raised.
        """
        reports = await self.finishing.gather_object(report, dst=0)
        outcome = _Outcome(None, Committed())
        commit_error: Exception | None = None
        if self.is_coordinator:
            assert reports is not None
            failed = [r for r in reports if r.error is not None]
            try:
                if failed:
                    outcome = _Outcome(_Failure(failed[0].rank, failed[0].error or ""),
                                       Committed())
                else:
                    try:
                        committed = await self._committer.commit(
                            tmp_dir, path, functools.partial(publish, reports, metadata), seq)
                        outcome = _Outcome(None, committed)
                    except Exception as error:  # every rank must reach the broadcast
                        commit_error = error
                        outcome = _Outcome(_Failure(0, describe(error)), Committed())
                if outcome.failure is not None:
                    await self._run_blocking(_remove_quietly, tmp_dir)
            finally:
                self._tmp_dirs.pop(tmp_dir).release()
        outcome = await self.finishing.broadcast_object(outcome, src=0)
        if commit_error is not None:
            raise commit_error
        failure = outcome.failure
        if failure is not None and failure.rank != self.rank:
            raise PeerError(f"checkpoint {path}: expected every rank to write its share, found "
                            f"rank {failure.rank} failing: {failure.what}; nothing was "
                            "committed", rank=failure.rank)
        return outcome.committed


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What the coordinator tells every rank at the end of a save."""

    failure: _Failure | None
    committed: Committed


def _remove_quietly(path: str) -> None:
    """Blocks: remove a failed save's tmp dir; a failure here is logged, not raised (the save's
    own error is the one that matters, and debris never looks committed)."""
    try:
        _sysio.remove_tree(path)
    except StorageError as error:
        logger.warning("could not remove the failed save's tmp dir: %s", error)


def describe(error: BaseException | None) -> str:
    """A failure as one line for the other ranks: its type and message."""
    if isinstance(error, asyncio.CancelledError):
        return "the save was cancelled"
    return f"{type(error).__name__}: {error}"


def _global_key(digests: Sequence[str]) -> str:
    return digest(memoryview("|".join(digests).encode())) + f"/{len(digests)}"


def prepare_tmp_dir(final_path: str, tmp_dir: str) -> DirLock:
    """Blocks: refuse an existing target, then create the tmp dir beside it (and its parents);
    returns the lock that marks the tmp dir live (release it once committed or removed)."""
    root = os.path.dirname(final_path)
    with _sysio.translate_os_errors("creating directory", root):
        os.makedirs(root, exist_ok=True)
    return _retention.make_tmp_dir(os.path.realpath(root), final_path, tmp_dir)
