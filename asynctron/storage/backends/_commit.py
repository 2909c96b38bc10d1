"""The commit protocol, whatever the backend: a checkpoint becomes visible all at once, or not
at all, and `latest` only ever moves forward.

Stages:
1. every rank's writers make its data files in the save's area durable;
2. `commit_checkpoint` (the coordinator): the backend writes the manifest into the area last
   and publishes the area as the checkpoint; then it moves `latest`, prunes, and removes the
   debris of dead saves. A save that fails before (or in) this stage is `discard`ed: its area
   never looks like a checkpoint.
`Committer` runs stage 2 for an engine: one commit per root at a time, and `latest` moved only
by a save newer than the last one it moved to.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping

from asynctron.storage.backends._backend import Committed, Retention, SaveArea, SaveStorage

logger = logging.getLogger(__name__)


async def commit_checkpoint(storage: SaveStorage, area: SaveArea,
                            files: Callable[[], Mapping[str, bytes]], *,
                            retention: Retention | None = None, seq: int = 0,
                            move_latest: bool = False) -> Committed:
    """Publish `area` as its checkpoint with `files()` (its manifest) written last; the
    problems after the commit that did not undo it are logged, not raised.

    Raises:
        FileExistsError: the checkpoint appeared meanwhile; nothing is committed.
        StorageError: writing or publishing failed; nothing is committed. Either way the area
            is left for the caller to `discard`.
    """
    committed = await storage.commit(area, files, retention=retention, seq=seq,
                                     move_latest=move_latest)
    for warning in committed.warnings:
        logger.warning("%s", warning)
    return committed


class Committer:
    """Commits an engine's saves: one per root at a time; `latest` only ever moves forward
    (or, with `points_latest=False`, is never written: a tier's shards). Used on the
    coordinator."""

    def __init__(self, retention: Retention | None, *, points_latest: bool = True) -> None:
        self._retention = retention
        self._points_latest = points_latest
        self._locks: dict[str, asyncio.Lock] = {}
        self._newest: dict[str, int] = {}

    async def commit(self, storage: SaveStorage, area: SaveArea,
                     files: Callable[[], Mapping[str, bytes]], seq: int) -> Committed:
        """`commit_checkpoint` for save `seq`, pointing `latest` at it unless a newer save
        already committed in its root. All in one backend call (a loop turn is a step of an
        async trainer that holds the loop).

        Raises:
            as `commit_checkpoint`.
        """
        root = os.path.dirname(area.final_path)
        lock = self._locks.setdefault(root, asyncio.Lock())
        async with lock:
            committed = await commit_checkpoint(
                storage, area, files, retention=self._retention,
                seq=seq, move_latest=self._points_latest and seq > self._newest.get(root, -1))
            if committed.moved_latest:
                self._newest[root] = seq
        return committed
