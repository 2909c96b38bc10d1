"""Loads every rank makes together (`load(..., collective=True)`): one rank finds the
checkpoint, every rank gets what it needs, every rank learns whether all of them succeeded.

Per load, on a gloo group of its own (collective loads take turns in call order, one at a
time, so every rank issues their collectives in the same order):
1. `locate`: rank 0 finds the checkpoint (follows `latest`: on an object store one listing
   and one manifest read for the whole job, never one per rank) and broadcasts the checkpoint
   path and its parsed manifest; an error there (nothing committed, a corrupt manifest) is
   raised on every rank as itself, so `except CheckpointNotFoundError` acts alike everywhere;
2. every rank gets what it needs: with `share` (the default on object stores), each stored
   item is read once per job and sent to the other ranks that need it (`ReadShare`); else
   each rank reads its own, with no collective;
3. `finish`: an all-gather of each rank's outcome: a rank whose read failed raises its own
   error, every other rank a `PeerError` naming it, so no rank trains on while another did not
   load (on a store, every rank raises within the deadline of the rank that failed).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from asynctron._concurrency import RunBlocking
from asynctron.comm import PeerChannel
from asynctron.engine._collectives import Collectives
from asynctron.engine._coordinator import describe
from asynctron.engine._shared_reads import ReadShare
from asynctron.engine._turns import Turns
from asynctron.errors import PeerError
from asynctron.storage import Manifest


@dataclass(frozen=True, slots=True)
class Located:
    """A checkpoint found by rank 0: its path (after `latest`) and its manifest."""

    path: str
    manifest: Manifest


@dataclass(frozen=True, slots=True)
class _Failed:
    """A rank's failure, as sent to the others: the error itself where it pickles."""

    rank: int
    what: str
    error: BaseException | None


class SharedLoads:
    """Runs the collective steps of loads on `group` (a `SoloCollectives` on one process),
    their shared reads' bytes on `channel` (None on one process).

    Not constructed directly; the engine makes one.
    """

    def __init__(self, group: Collectives, channel: PeerChannel | None = None) -> None:
        self._group = group
        self._channel = channel
        self._turns = Turns()
        self._seq = 0

    @property
    def rank(self) -> int:
        return self._group.rank

    def next_seq(self) -> int:
        """The next load's place in the order (every rank numbers its loads alike)."""
        self._seq += 1
        return self._seq

    def turn(self, seq: int) -> contextlib.AbstractAsyncContextManager[None]:
        """Load `seq`'s turn: its collectives run after those of the loads before it."""
        return self._turns.take(seq)

    def share(self, seq: int, run_blocking: RunBlocking) -> ReadShare | None:
        """Load `seq`'s shared reads (within its turn); None on one process."""
        if self._channel is None:
            return None
        return ReadShare(self._group, self._channel, tag=seq % (1 << 20),
                         run_blocking=run_blocking)

    async def locate(self, find: Callable[[], Awaitable[Located]]) -> Located:
        """Rank 0's `find()`, shared with every rank (within the load's turn).

        Raises:
            rank 0's error, on every rank (a `PeerError` naming it where it does not pickle).
        """
        found: Located | _Failed | None = None
        own_error: BaseException | None = None
        if self.rank == 0:
            try:
                found = await find()
            except Exception as error:  # every rank must reach the broadcast
                own_error = error
                found = _failure(0, error)
        found = await self._group.broadcast_object(found, src=0)
        if own_error is not None:
            raise own_error
        if isinstance(found, _Failed):
            if found.error is not None:
                raise found.error
            raise PeerError(f"load: expected rank 0 to find the checkpoint, found {found.what}",
                            rank=0)
        assert isinstance(found, Located)
        return found

    async def finish(self, error: BaseException | None) -> None:
        """Tell every rank this rank's outcome (`error`, or None) and learn theirs (within the
        load's turn).

        Raises:
            PeerError: another rank failed (this one succeeded, or failed too: its own error
                is raised by the caller).
        """
        sent = None if error is None else _Failed(self.rank, describe(error), None)
        outcomes = await self._group.all_gather_object(sent)
        failed = [outcome for outcome in outcomes if outcome is not None]
        if error is None and failed:
            first = failed[0]
            raise PeerError(f"load: expected every rank to load its share, found rank "
                            f"{first.rank} failing: {first.what}", rank=first.rank)

    def close(self) -> None:
        """Let the channel's threads go."""
        if self._channel is not None:
            self._channel.close()


def _failure(rank: int, error: BaseException) -> _Failed:
    """`error` as sent to the other ranks: itself where it pickles, else its description."""
    try:
        pickle.dumps(error)
    except Exception:  # an error carrying what does not pickle: its description will do
        return _Failed(rank, describe(error), None)
    return _Failed(rank, describe(error), error)
