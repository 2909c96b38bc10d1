"""The object collectives the save protocol runs on: across ranks `asynctron.comm`'s
`CollectiveGroup`; on one process `SoloCollectives`, which sends nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


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
