"""`asynctron.save` / `asynctron.load` / `asynctron.load_into`: one call each, for scripts with no
event loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Mapping
from typing import Any, Literal, TypeVar, Unpack

import uvloop

from asynctron.engine._config import EngineConfig, EngineOptions
from asynctron.engine._engine import Engine
from asynctron.engine._task import SaveResult

T = TypeVar("T")


def _run(name: str, coroutine: Coroutine[Any, Any, T]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coroutine)
    coroutine.close()
    raise RuntimeError(f"asynctron.{name}() called inside a running event loop; "
                       f"use `async with Engine() as engine: await engine.{name}(...)`")


def save(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
         format: Literal["asynctron", "dcp"] = "asynctron", config: EngineConfig | None = None,
         **options: Unpack[EngineOptions]) -> SaveResult:
    """Save `state_dict` to `path` and return once committed (own loop, own engine, configured
    as `Engine(config, **options)`; see `Engine.save` for `format`).

    The caller waits for the commit, so nothing is snapshotted: CPU tensors are written from
    their own memory, with no copy and no staging memory to fault in (`snapshot=False`).
    They must not change until this returns (say, from another thread).
    """

    async def main() -> SaveResult:
        async with Engine(config, **options) as engine:
            return await engine.save(state_dict, path, snapshot=False, format=format)

    return _run("save", main())


def load(path: str | os.PathLike[str], *, mmap: bool = False, verify: bool | None = None,
         config: EngineConfig | None = None, **options: Unpack[EngineOptions]
         ) -> dict[str, Any]:
    """Load the checkpoint at `path` into new objects (see `Engine.load`), with its own loop
    and engine."""

    async def main() -> dict[str, Any]:
        async with Engine(config, **options) as engine:
            return await engine.load(path, mmap=mmap, verify=verify)

    return _run("load", main())


def load_into(state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
              verify: bool = True, config: EngineConfig | None = None,
              **options: Unpack[EngineOptions]) -> dict[str, Any]:
    """Load the checkpoint at `path` into `state_dict`'s tensors and arrays, in place (see
    `Engine.load_into`), with its own loop and engine."""

    async def main() -> dict[str, Any]:
        async with Engine(config, **options) as engine:
            return await engine.load_into(state_dict, path, verify=verify)

    return _run("load_into", main())
