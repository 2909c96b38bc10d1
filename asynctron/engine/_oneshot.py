"""`asynctron.save` / `asynctron.load`: one call each, for scripts with no event loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any, Literal

import uvloop

from asynctron.engine._engine import Engine
from asynctron.engine._task import SaveResult


def _run(name: str, coroutine: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coroutine)
    coroutine.close()
    raise RuntimeError(f"asynctron.{name}() called inside a running event loop; "
                       f"use `async with Engine() as engine: await engine.{name}(...)`")


def save(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
         format: Literal["asynctron", "dcp"] = "asynctron", **engine_kwargs: Any) -> SaveResult:
    """Save `state_dict` to `path` and return once committed (own loop, own engine; see
    `Engine.save` for `format`).

    The caller waits for the commit, so nothing is snapshotted: CPU tensors are written from
    their own memory, with no copy and no staging memory to fault in (`snapshot=False`).
    They must not change until this returns (say, from another thread).
    """

    async def main() -> SaveResult:
        async with Engine(**engine_kwargs) as engine:
            return await engine.save(state_dict, path, snapshot=False, format=format)

    return _run("save", main())


def load(path: str | os.PathLike[str], *, into: Mapping[str, Any] | None = None,
         mmap: bool = False, verify: bool | None = None, **engine_kwargs: Any) -> Any:
    """Load the checkpoint at `path` (see `Engine.load`), with its own loop and engine."""

    async def main() -> Any:
        async with Engine(**engine_kwargs) as engine:
            return await engine.load(path, into=into, mmap=mmap, verify=verify)

    return _run("load", main())
