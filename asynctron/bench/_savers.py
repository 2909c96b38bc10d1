"""How each library saves from inside the GPU trainer benchmark (`cuda_trainer`), each with its
best settings, each ending with the checkpoint durable (its data files fsynced):

- `asynctron`: `Engine.save` on the trainer's own event loop (an asyncio trainer), staging
  memory sized to the state and made ready before the first save;
- `asynctron BackgroundEngine`: the same engine on its own loop thread, called from a
  synchronous trainer;
- `dcp async_save zoc (thread|process)`: DCP's zero-overhead checkpointing, a persistent
  `DefaultStager(StagingOptions(True, True, True, True))` (one per save on torch 2.11 and 2.12,
  whose stager stages once: `_peers.OneStagerPerSave`) (pinned and shared staging memory,
  staged on a background thread with non-blocking copies on a side stream; on a CPU run the two
  CUDA-only options are off), with `AsyncCheckpointerType.THREAD` or `.PROCESS` (torchtitan's
  `async_with_pinned_mem`), `FileSystemWriter(sync_files=True)`;
- `dcp async_save (default)`: what `dcp.async_save(sd, storage_writer=...)` does with no stager,
  a fresh CPU copy on the caller's thread (the reference of issue 30's first run);
- `megatron FileSystemWriterAsync`: Megatron-core's async writer (see `_peers`), where it
  imports.

A saver's `start` runs on the trainer's thread as the trainer would call it; the handle it
returns says when the trainer may change its tensors and when the save was durable, each
measured from the request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from asynctron import BackgroundEngine, Engine, SaveResult, SaveTask
from asynctron.bench import _peers

MiB = 1 << 20

OURS = "asynctron"
OURS_BACKGROUND = "asynctron BackgroundEngine"
ZOC_THREAD = "dcp async_save zoc (thread)"
ZOC_PROCESS = "dcp async_save zoc (process)"
DCP_DEFAULT = "dcp async_save (default)"
MEGATRON = "megatron FileSystemWriterAsync"
#: every saver, in the order the benchmark runs them (a run cut short by a time budget keeps
#: the first ones: asynctron and DCP's best, then the rest)
NAMES = (OURS, ZOC_PROCESS, ZOC_THREAD, OURS_BACKGROUND, DCP_DEFAULT, MEGATRON)


class SaveHandle:
    """One save in flight, as the trainer sees it. `wait_staged` blocks (or awaits) until the
    trainer may change its tensors; `wait_durable` until the checkpoint is durable, after which
    `staged_s` and `durable_s` (from the request) are known."""

    def __init__(self, requested: float) -> None:
        self.requested = requested
        self.staged_s = float("nan")
        self.durable_s = float("nan")

    async def wait_staged(self) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    async def wait_durable(self) -> None:
        raise NotImplementedError


class Saver:
    """One library's way to save: `open` once (outside any timing), `start` per save,
    `close` at the end."""

    name: str

    async def open(self) -> None:
        return None

    async def start(self, state: dict[str, Any], path: str) -> SaveHandle:
        raise NotImplementedError

    async def close(self) -> None:
        return None


def _engine_options(nbytes: int, device: torch.device) -> dict[str, Any]:
    """Staging for a whole save at once (no save waits for a write to free memory); pinned
    on a GPU."""
    budget = (nbytes // (64 * MiB) + 2) * 64 * MiB
    return {"memory_budget_bytes": budget, "pin_memory": device.type == "cuda"}


class _TaskHandle(SaveHandle):
    def __init__(self, task: SaveTask, requested: float, *, on_loop: bool) -> None:
        super().__init__(requested)
        self._task = task
        self._on_loop = on_loop

    async def wait_staged(self) -> None:
        if self._on_loop:
            await self._task.staged
        else:
            self._task.staged.result()

    def done(self) -> bool:
        return self._task.done()

    async def wait_durable(self) -> None:
        result: SaveResult = await self._task if self._on_loop else self._task.result()
        self.staged_s, self.durable_s = result.stage_s, result.total_s


class AsynctronSaver(Saver):
    """`Engine.save` on the trainer's loop: the trainer awaits `task.staged`."""

    name = OURS

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._engine = Engine(**_engine_options(nbytes, device))

    async def open(self) -> None:
        await self._engine.start()
        await self._engine.prefault_staging()

    async def start(self, state: dict[str, Any], path: str) -> SaveHandle:
        requested = time.perf_counter()
        return _TaskHandle(self._engine.save(state, path), requested, on_loop=True)

    async def close(self) -> None:
        await self._engine.aclose()


class BackgroundSaver(Saver):
    """`BackgroundEngine.save` from a synchronous trainer: `task.staged.result()` blocks it."""

    name = OURS_BACKGROUND

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._options = _engine_options(nbytes, device)
        self._engine: BackgroundEngine | None = None

    async def open(self) -> None:
        self._engine = BackgroundEngine(**self._options)
        self._engine.prefault_staging()

    async def start(self, state: dict[str, Any], path: str) -> SaveHandle:
        assert self._engine is not None
        requested = time.perf_counter()
        return _TaskHandle(self._engine.save(state, path), requested, on_loop=False)

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


class _FutureHandle(SaveHandle):
    """DCP's futures: `staging` (None: staged when `async_save` returned) and `upload`; their
    completion times are taken by callbacks, on the thread that completes them."""

    def __init__(self, requested: float, staging: Future | None, upload: Future) -> None:
        super().__init__(requested)
        self._staging = staging
        self._upload = upload
        self._staged_at = time.perf_counter() if staging is None else float("nan")
        self._durable_at = float("nan")
        if staging is not None:
            staging.add_done_callback(lambda _: self._mark("_staged_at"))
        upload.add_done_callback(lambda _: self._mark("_durable_at"))

    def _mark(self, attribute: str) -> None:
        setattr(self, attribute, time.perf_counter())

    async def wait_staged(self) -> None:
        if self._staging is not None:
            self._staging.result()

    def done(self) -> bool:
        return self._upload.done()

    async def wait_durable(self) -> None:
        self._upload.result()
        if self._staging is not None:
            self._staging.result()
        self.staged_s = self._staged_at - self.requested
        self.durable_s = self._durable_at - self.requested


class DcpSaver(Saver):
    """`dcp.async_save` with zero-overhead staging (`zoc`) in thread or process mode, or with
    its default staging (thread mode, a fresh copy per save)."""

    def __init__(self, device: torch.device, *, zoc: bool, process: bool = False,
                 thread_count: int = 4) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if process and not zoc:
            raise ValueError("process: DCP's process mode is measured with zoc staging only")
        self.name = (ZOC_PROCESS if process else ZOC_THREAD) if zoc else DCP_DEFAULT
        self._device = device
        self._zoc = zoc
        self._process = process
        self._type = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self._thread_count = thread_count
        self._stagers: _peers.OneStagerPerSave | None = None
        self.options: dict[str, bool] = {}

    async def open(self) -> None:
        if self._process:
            _peers._ensure_single_rank_process_group()
        if self._zoc:
            from torch.distributed.checkpoint.staging import StagingOptions

            cuda = self._device.type == "cuda"  # the two options DCP allows only with CUDA
            self.options = {"use_pinned_memory": cuda, "use_shared_memory": True,
                            "use_async_staging": True, "use_non_blocking_copy": cuda}
            self._stagers = _peers.OneStagerPerSave(StagingOptions(**self.options))
            self.options["stager_kept_across_saves"] = self._stagers.kept

    async def start(self, state: dict[str, Any], path: str) -> SaveHandle:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(path, thread_count=self._thread_count, sync_files=True)
        requested = time.perf_counter()
        stager = self._stagers.for_save() if self._stagers is not None else None
        response = dcp.async_save(state, storage_writer=writer, async_stager=stager,
                                  async_checkpointer_type=self._type,
                                  no_dist=not self._process)
        if isinstance(response, Future):
            return _FutureHandle(requested, None, response)
        return _FutureHandle(requested, response.staging_completion,
                             response.upload_completion)

    async def close(self) -> None:
        if self._stagers is not None:
            self._stagers.close()


class _MegatronHandle(SaveHandle):
    """Megatron's save: staged once its writer process is forked (`start` returned); a thread
    joins the writer and finalizes (`.metadata`), taking the time it is durable."""

    def __init__(self, requested: float, save: _peers.MegatronSave) -> None:
        super().__init__(requested)
        self.staged_s = time.perf_counter() - requested
        self._error: BaseException | None = None
        self._finisher = threading.Thread(target=self._finish, args=(save,),
                                          name="megatron-finish", daemon=True)
        self._finisher.start()

    def _finish(self, save: _peers.MegatronSave) -> None:
        try:
            save.finish()
            self.durable_s = time.perf_counter() - self.requested
        except BaseException as error:  # handed to wait_durable
            self._error = error

    async def wait_staged(self) -> None:
        return None

    def done(self) -> bool:
        return not self._finisher.is_alive()

    async def wait_durable(self) -> None:
        self._finisher.join()
        if self._error is not None:
            raise self._error


class MegatronSaver(Saver):
    """Megatron-core's `FileSystemWriterAsync`: it copies device tensors to the CPU on the
    caller (`preload_tensors`), then forks its writer."""

    name = MEGATRON

    async def start(self, state: dict[str, Any], path: str) -> SaveHandle:
        requested = time.perf_counter()
        return _MegatronHandle(requested, _peers.start_megatron_async(state, path))


def make_savers(names: list[str], nbytes: int, device: torch.device, *,
                dcp_threads: int) -> tuple[list[Saver], dict[str, str]]:
    """The savers named (in `NAMES` order) that this machine can run, and why the others
    cannot."""
    factories: dict[str, Callable[[], Saver]] = {
        OURS: lambda: AsynctronSaver(nbytes, device),
        OURS_BACKGROUND: lambda: BackgroundSaver(nbytes, device),
        ZOC_THREAD: lambda: DcpSaver(device, zoc=True, thread_count=dcp_threads),
        ZOC_PROCESS: lambda: DcpSaver(device, zoc=True, process=True,
                                      thread_count=dcp_threads),
        DCP_DEFAULT: lambda: DcpSaver(device, zoc=False, thread_count=dcp_threads),
        MEGATRON: MegatronSaver,
    }
    savers: list[Saver] = []
    not_run: dict[str, str] = {}
    for name in NAMES:
        if name not in names:
            continue
        if name == MEGATRON and (reason := _peers.megatron_available()) is not None:
            not_run[name] = reason
        else:
            savers.append(factories[name]())
    return savers, not_run
