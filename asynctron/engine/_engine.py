"""`Engine`: the checkpoint engine bound to one running event loop.

It owns its `SaveResources` (the bounded executor, the only door for blocking calls; the
staging pool under the memory budget; the CUDA copy streams; the storage backend), the save
protocol's coordinator, and every save task it started.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import warnings
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, TypeVar, Unpack

import torch.distributed as dist

from asynctron._budget import ByteBudget
from asynctron._concurrency import uncancellable
from asynctron._config import resolve_config
from asynctron.comm import CollectiveGroup, PeerChannel, new_gloo_group
from asynctron.engine._collectives import Collectives, SoloCollectives
from asynctron.engine._config import EngineConfig, EngineOptions
from asynctron.engine._coordinator import Coordinator
from asynctron.engine._load import Loader, Loads
from asynctron.engine._plan_cache import PlanCache
from asynctron.engine._resources import SaveResources
from asynctron.engine._save import SaveJob, SaveOptions
from asynctron.engine._shared_loads import Located, SharedLoads
from asynctron.engine._shared_reads import ReadShare
from asynctron.engine._staging import mark_ready
from asynctron.engine._task import SaveResult, SaveTask
from asynctron.engine.tiers import RestoreResult, Tiers
from asynctron.engine.tiers._config import job_nodes
from asynctron.engine.tiers._manager import TierManager
from asynctron.errors import BusyError, ClosedError, PeerTimeoutError
from asynctron.storage import Backend, Retention, backend_for, store_operation
from asynctron.storage.backends import (
    CheckpointReader,
    CheckpointStorage,
    Committer,
)

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Engine:
    """The asynctron checkpoint engine. Use as `async with Engine(...) as engine:`.

    Binds to the running loop on entry. Configured by `config` (an `EngineConfig`) or by its
    fields as keywords (`Engine(num_workers=2)`), not both. `backend` stores every checkpoint
    (a fault-injecting fake of `asynctron.testing` in tests); by default each path's own
    (`asynctron.storage.backend_for`: the local filesystem for a plain path).

    Across ranks: when torch.distributed is initialized with several ranks, every rank saves
    its share of the same checkpoint (its own files, replicated tensors written once) and the
    checkpoint commits only if every rank succeeded. Coordination runs on dedicated gloo
    groups (two for saves, two for collective loads and their shared reads; made on entry,
    of all ranks or of `process_group`'s: entering is collective, like `dist.new_group`),
    never on the training group.

    With `tiers` (`Engine(tiers=Tiers(local=..., store=...))`), `save(state, step=N)` saves to
    the tiers and `restore(state)` restores from the nearest that verifies; `store_backend`
    is the store's backend (default: the one `tiers.store`'s URL names), and `backend`, when
    given, is the local tier's.

    Concurrency: any number of saves and loads may be in flight; two saves to one path raise
    BusyError.
    """

    def __init__(self, config: EngineConfig | None = None, *, backend: Backend | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 store_backend: Backend | None = None,
                 **options: Unpack[EngineOptions]) -> None:
        self.config = resolve_config("Engine", EngineConfig, config, options)
        if store_backend is not None and (self.config.tiers is None
                                          or self.config.tiers.store is None):
            raise ValueError("store_backend: expected with tiers that have a store "
                             "(Engine(tiers=Tiers(..., store=...))), found no store")
        self._store_backend = store_backend
        self._tiers: TierManager | None = None
        if process_group is not None and dist.get_backend(process_group) != "gloo":
            raise ValueError(f"process_group: expected a gloo group for coordination, found "
                             f"{dist.get_backend(process_group)!r}; create one with "
                             "asynctron.comm.new_gloo_group")
        self._process_group = process_group
        self._resources = SaveResources(self.config, backend)
        self._loads = Loads(self._resources)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._saves: dict[str, asyncio.Task[SaveResult]] = {}
        self._cancelling_saves = False
        """Whether the engine itself cancelled its saves (leaving on an error, or a cancelled
        `aclose`)."""
        self._failed: list[SaveTask] = []
        self._num_loads = 0
        self._loads_done = asyncio.Event()
        self._loads_done.set()
        self._seq = 0
        self._closed = False
        self.budget: ByteBudget = self._resources.budget
        self._coordinator: Coordinator | None = None
        self._shared_loads: SharedLoads | None = None
        self.plan_cache = PlanCache(max_entries=8)

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._cancelling_saves = True
            for task in self._saves.values():
                task.cancel()
        await self.aclose(raise_unobserved=exc_type is None)

    async def start(self) -> None:
        """Bind to the running loop, start the executor and, across ranks, join the coordination
        group (done by `async with`).

        Raises:
            PeerTimeoutError: a rank did not start its engine within `coordination_timeout_s`;
                this engine is left unstarted, with nothing running.

        Concurrency: across ranks this is collective (gloo groups for finishing saves and for
        collective loads are created, and one for planning unless `process_group` was given):
        every rank starts its engine, in the same order relative to its other group creations.
        """
        if self._closed:
            raise ClosedError("engine: closed; create a new Engine")
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._resources.start()
        try:
            planning, finishing, loads, channel = await self._collectives()
        except BaseException:  # e.g. a rank never joined: leave nothing running
            self._loop = None
            self._resources.shutdown(unbind=True)
            raise
        self._coordinator = Coordinator(planning, finishing, self.run_blocking,
                                        Committer(self._retention()))
        self._shared_loads = SharedLoads(loads, channel)
        if self.config.tiers is not None:
            try:
                self._tiers = await self._tier_manager(self.config.tiers)
            except BaseException:
                self._loop = None
                self._resources.shutdown(unbind=True)
                raise
        logger.debug("engine started: %s, rank %d of %d", self.config,
                     self._coordinator.rank, self._coordinator.world_size)

    def _retention(self) -> Retention | None:
        if self.config.keep_last is None:
            return None
        engine = secrets.token_hex(8)
        return Retention(job=self.config.job or f"engine-{engine}", engine=engine,
                         keep_last=self.config.keep_last)

    async def _tier_manager(self, tiers: Tiers) -> TierManager:
        """The tiers on this rank: its node, its local tier and the store, and (across ranks)
        four more gloo groups: the shards' planning, the steps' agreement, the drains, the
        replicas' streams."""
        coordinator = self._started()
        nodes = job_nodes(tiers, coordinator.rank, coordinator.world_size)
        local = self._resources.backend_of(tiers.local_root(nodes.node))
        store = None
        if tiers.store is not None:
            store = self._store_backend or backend_for(tiers.store)
        planning: Collectives = SoloCollectives()
        agree: Collectives = SoloCollectives()
        drains: Collectives = SoloCollectives()
        channel = None
        if coordinator.world_size > 1:
            timeout_s = self.config.coordination_timeout_s
            ranks = (None if self._process_group is None
                     else dist.get_process_group_ranks(self._process_group))
            new_group = functools.partial(new_gloo_group, timeout_s=timeout_s, ranks=ranks)
            groups = [await self.run_blocking(new_group) for _ in range(4)]
            planning, agree, drains = (CollectiveGroup(group, run_blocking=self.run_blocking,
                                                       timeout_s=timeout_s)
                                       for group in groups[:3])
            channel = PeerChannel(groups[3])
        retention = None
        if tiers.keep_store is not None:
            retention = Retention(job=self.config.job or "asynctron-tiers",
                                  engine=secrets.token_hex(8), keep_last=tiers.keep_store)
        manager = TierManager(tiers, nodes, resources=self._resources, loads=self._loads,
                              local=local,
                              store=store, planning=planning, agree=agree, drains=drains,
                              channel=channel, plan_cache=self.plan_cache,
                              store_retention=retention)
        await manager.start()
        return manager

    async def _collectives(self) -> tuple[Collectives, Collectives, Collectives,
                                          PeerChannel | None]:
        """The save protocol's two groups (planning, finishing), the collective loads' and
        their shared reads' channel: gloo groups across ranks."""
        if self._process_group is None and not (dist.is_available() and dist.is_initialized()
                                                and dist.get_world_size() > 1):
            return SoloCollectives(), SoloCollectives(), SoloCollectives(), None
        timeout_s = self.config.coordination_timeout_s
        ranks = (None if self._process_group is None
                 else dist.get_process_group_ranks(self._process_group))
        new_group = functools.partial(new_gloo_group, timeout_s=timeout_s, ranks=ranks)
        try:
            planning = self._process_group or await self.run_blocking(new_group)
            finishing = await self.run_blocking(new_group)
            loads = await self.run_blocking(new_group)
            channel = PeerChannel(await self.run_blocking(new_group))
        except RuntimeError as error:  # dist.DistError: a rank never came
            raise PeerTimeoutError(
                "engine start: expected every rank to start its Engine (creating the "
                f"coordination groups), found a rank absent within {timeout_s:g} s "
                f"({type(error).__name__}: {error}); start an Engine on every rank, in the same "
                "order relative to other process-group creations", rank=None) from error
        planning, finishing, loads = (
            CollectiveGroup(group, run_blocking=self.run_blocking, timeout_s=timeout_s)
            for group in (planning, finishing, loads))
        return planning, finishing, loads, channel

    @property
    def rank(self) -> int:
        """This process's rank in the checkpoint coordination group (0 on one process)."""
        return self._started().rank

    @property
    def num_coordination_calls(self) -> int:
        """Collectives the save protocol has issued so far (on its dedicated gloo groups; 0 on
        one process)."""
        return self._started().num_calls

    def _started(self) -> Coordinator:
        if self._coordinator is None:
            raise RuntimeError("engine: not started; use `async with Engine() as engine`")
        return self._coordinator

    async def aclose(self, *, raise_unobserved: bool = True) -> None:
        """Wait for every save (and load) in flight, then stop the executor. The staging slabs
        stay in the process-wide cache for later engines (`asynctron.free_idle_staging()`
        frees them).

        Raises:
            the error of the first failed save whose `SaveTask` nobody awaited (nor asked for
            its result), unless `raise_unobserved` is False: a failed checkpoint is never
            silent (every failure is also logged when it happens).

        With tiers, the drain to the store in flight is waited for too.

        Cancellation: the saves in flight are cancelled (their tmp dirs removed) and the
        executor still shuts down.
        """
        if self._closed:
            return
        self._closed = True
        loads = asyncio.ensure_future(self._loads_done.wait())  # no new save or load starts now
        try:
            await asyncio.wait([*self._saves.values(), loads])
        except asyncio.CancelledError:
            self._cancelling_saves = True
            for task in self._saves.values():
                task.cancel()
            await uncancellable(asyncio.ensure_future(asyncio.wait(list(self._saves.values()))))
            raise
        else:
            if self._tiers is not None:
                await self._tiers.aclose()
            if self._shared_loads is not None:
                self._shared_loads.close()
            unobserved = [handle for handle in self._failed if not handle.observed]
            if unobserved and raise_unobserved:
                raise unobserved[0].failure()
        finally:
            loads.cancel()
            self._resources.shutdown()

    async def prefault_staging(self, nbytes: int | None = None) -> int:
        """Allocate and touch staging slabs for `nbytes` (default and at most:
        `memory_budget_bytes`) now, off the loop, so that the first save copies into warm
        pages instead of paying the first touch of every page (several times a copy, on a VM).
        The slabs stay in the process-wide cache. Returns the bytes made ready.

        Memory: at most `memory_budget_bytes`, borrowed from the engine's budget while they
        are touched (a save running meanwhile shares it).
        Cancellation: the slabs touched so far stay ready.
        """
        self._check_open()
        budget = self.config.memory_budget_bytes
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                                   or nbytes < 0):
            raise ValueError(f"nbytes: expected None or an int >= 0, found {nbytes!r}")
        pool = self._resources.pool
        return await pool.prefault(budget if nbytes is None else min(nbytes, budget))

    def _check_open(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise ClosedError("engine: closed; create a new Engine")
        if self._loop is None:
            raise RuntimeError("engine: not started; use `async with Engine() as engine`")
        return self._loop

    async def run_blocking(self, fn: Callable[..., T], /, *args: Any) -> T:
        """Run blocking `fn(*args)` on the engine's executor; the loop stays free.

        The result reaches the awaiting task in two loop iterations (the thread's callback,
        then the task): an async trainer whose steps hold the loop gives one per step.

        Cancellation: the thread cannot be interrupted; the call finishes, then the
        cancellation is raised (so no buffer is reused while a thread still touches it).
        """
        return await self._resources.run_blocking(fn, *args)

    def save(self, state_dict: Mapping[str, Any], path: str | os.PathLike[str] | None = None,
             *, step: int | None = None, snapshot: bool = True,
             format: Literal["asynctron", "dcp"] = "asynctron") -> SaveTask:
        """Start saving `state_dict` to the new directory `path` (or, with `step`, to the
        engine's tiers); returns at once (whatever the state dict's size: it is read on the
        executor, never on the loop).

        The state dict and its tensors must not change until `await task.staged`: the
        snapshot is their value then, and for CUDA tensors the value after the work queued on
        the current device's current stream before this call.

        Args:
            state_dict: nested dicts/lists/tuples of tensors (CPU or CUDA), numpy arrays,
                bytes, and JSON values (str, int, float, bool, None).
            path: the checkpoint directory to create; its parent gets a `latest` pointer.
            step: instead of `path`, with `Engine(tiers=...)`: this rank's shard of step
                `step`, committed into its node's local tier and the replicas' (collective:
                every rank saves the same step); every `store_every`-th complete step is then
                drained to the store in the background. `await task` resolves once the step
                is complete on every rank (its `SaveResult.step` set).
            snapshot: copy tensors out (True), so they may change after `await task.staged`;
                False writes CPU tensors in place, and they must not change until `await task`
                (no copy: the fastest save for a caller that waits for the commit anyway).
                A save to the tiers always copies (its replicas are sent from the copy).
            format: `"asynctron"`; or `"dcp"`: also readable by stock
                `torch.distributed.checkpoint.load` (and Megatron's torch_dist loader): tensors
                as `torch.save` blobs, other values pickled as DCP pickles them, a `.metadata`
                beside the manifest; written by the same pipeline, at the same speed. Such a
                save is planned afresh each time (no plan cache).

        Returns:
            a `SaveTask`: `await task.staged`, then `await task` for the `SaveResult`.

        Raises:
            ValueError: an unknown `format`; neither or both of `path` and `step`; `step`
                without tiers, or with `format="dcp"` or `snapshot=False`.
            TypeError: `state_dict` is not a dict.
            BusyError: a save to the same path (or step) is already in flight.
            ClosedError: the engine is closed.
        The task (and `task.staged`) raises TypeError or ValueError for bad keys, leaves or
        dtypes (naming the key; nothing is written), FileExistsError if `path` exists,
        StorageError on I/O failure, PeerError when another rank failed.

        Memory: staging holds at most `memory_budget_bytes` (shared by all saves).
        """
        loop = self._check_open()
        if format not in ("asynctron", "dcp"):
            raise ValueError(f"format: expected 'asynctron' or 'dcp', found {format!r}")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a dict, found {type(state_dict).__name__}; "
                            "wrap the value in a dict")
        tiers = self._check_step(path, step, snapshot=snapshot, format=format)
        if tiers is not None:
            assert step is not None
            storage, target = tiers.local, tiers.shard_path(step)
        else:
            assert path is not None
            storage, target = self._resources.locate(path)
        if target in self._saves:
            raise BusyError(f"checkpoint {target}: a save to this path is already in flight; "
                            "await it first or save to another path")
        options = SaveOptions(num_bins=self.config.num_bins, snapshot=snapshot,
                              slab_bytes=self.config.slab_bytes,
                              direct_io=self.config.direct_io, checksum=self.config.checksum,
                              format=format)
        self._seq += 1
        staged: asyncio.Future[None] = loop.create_future()

        def on_staged() -> None:
            if not staged.done():
                staged.set_result(None)

        work: Callable[[], Awaitable[SaveResult]]
        if tiers is not None:
            assert step is not None
            work = functools.partial(tiers.save, state_dict, step, options=options,
                                     ready=mark_ready(), on_staged=on_staged)
        else:
            work = SaveJob(state_dict, target, seq=self._seq, options=options,
                           ready=mark_ready(), storage=storage, resources=self._resources,
                           coordinator=self._started(), plan_cache=self.plan_cache,
                           on_staged=on_staged).run
        task = loop.create_task(self._run_save(work, target, staged),
                                name=f"asynctron-save:{target}")
        self._saves[target] = task
        handle = SaveTask(task, staged, loop, target)
        task.add_done_callback(lambda _: self._settled(handle))
        return handle

    def _check_step(self, path: str | os.PathLike[str] | None, step: int | None, *,
                    snapshot: bool, format: str) -> TierManager | None:
        """The tiers a save goes to (with `step`), or None (to `path`).

        Raises:
            ValueError: neither or both of `path` and `step`, or a `step` the tiers cannot
                take (naming why).
        """
        if step is None:
            if path is None:
                raise ValueError("save: expected a path (or, with Engine(tiers=...), step=), "
                                 "found neither")
            return None
        if path is not None:
            raise ValueError(f"save: expected a path or step=, found both ({path!r}, "
                             f"step={step!r}); the tiers choose a step's path")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an int >= 0, found {step!r}")
        if self._tiers is None:
            raise ValueError(f"save step={step}: expected an engine with tiers "
                             "(Engine(tiers=asynctron.Tiers(local=...))), found none; pass "
                             "a path instead")
        if format != "asynctron" or not snapshot:
            raise ValueError(f"save step={step}: expected format='asynctron' and snapshot=True "
                             f"(a tier's replicas are sent from the staged copy), found "
                             f"format={format!r}, snapshot={snapshot!r}")
        return self._tiers

    def _settled(self, handle: SaveTask) -> None:
        if handle.failed():
            self._failed.append(handle)
        elif handle.cancelled() and not (handle.cancel_requested or self._cancelling_saves):
            message = (f"checkpoint {handle.path}: the save was cancelled before it committed, "
                       "neither by its SaveTask nor by the engine (most likely by the event "
                       "loop's shutdown: asyncio.run returned with the save in flight); nothing "
                       "was saved. Await the save, or leave `async with Engine()` (or await "
                       "`engine.aclose()`) before the loop ends")
            logger.error("%s", message)
            warnings.warn(message, RuntimeWarning, stacklevel=1)

    async def _run_save(self, work: Callable[[], Awaitable[SaveResult]], target: str,
                        staged: asyncio.Future[None]) -> SaveResult:
        try:
            return await work()
        except BaseException as error:
            if not isinstance(error, asyncio.CancelledError):
                logger.error("checkpoint %s: save failed: %s: %s", target,
                             type(error).__name__, error)
            if not staged.done():
                if isinstance(error, asyncio.CancelledError):
                    staged.cancel()
                else:
                    staged.set_exception(error)
                    staged.exception()  # retrieved here; the SaveTask carries it to the caller
            raise
        finally:
            del self._saves[target]

    async def load(self, path: str | os.PathLike[str], *, mmap: bool = False,
                   verify: bool | None = None, collective: bool = False) -> dict[str, Any]:
        """Load the checkpoint at `path` (or the one `path/latest` names) into new objects.

        Args:
            mmap: return tensors backed by copy-on-write maps of the files (nothing is read
                until touched; writes never reach the files). Items stored as several chunks
                (sharded, or cut to spread over bins) are read instead.
            verify: check every item's checksum; default True, but False with `mmap` (checking
                would read every byte). A checkpoint saved without checksums has none to check.
            collective: every rank of the engine's job calls this load (in the same order as
                its other collective loads): rank 0 finds the checkpoint (on a store: one
                listing for the job, not one per rank) and every rank reads that one; a
                failure on any rank raises on every rank. No effect on one process.

        Returns:
            the saved state dict: fresh CPU tensors (or mapped ones), numpy arrays, bytes and
            JSON values, in the saved structure.

        Raises:
            CheckpointNotFoundError: nothing committed at `path`.
            CorruptCheckpointError: a bad manifest, a short file or a checksum mismatch,
                naming file, key and offset.
            PeerError: (`collective`) another rank's load failed.

        Cancellation: reads in flight finish; nothing is returned.
        Concurrency: on a local path, no `keep_last` pruning (of any process) deletes the
        checkpoint while it loads, and `mmap` tensors stay valid after a later pruning (the
        maps keep the files). An object store has no lease: a checkpoint pruned meanwhile
        fails the load clearly (a missing object), never with wrong bytes.
        On an object store the load is one operation: it fails once the store has answered
        none of its requests for the backend's deadline.
        Memory: fresh tensors as saved (none with `mmap`, for single-chunk items).
        """
        self._check_open()
        return await self._load(path, (not mmap) if verify is None else verify,
                                Loader.mapped if mmap else Loader.fresh, collective=collective)

    async def load_into(self, state_dict: Mapping[str, Any], path: str | os.PathLike[str], *,
                        verify: bool = True, collective: bool = False) -> dict[str, Any]:
        """Load the checkpoint at `path` (or the one `path/latest` names) into the tensors and
        arrays of `state_dict`, in place (CPU, CUDA or DTensor shards, resharding as needed).

        Args:
            state_dict: the state to fill, as `save` took it; every tensor and array in it must
                match a saved one by key, dtype and (global) shape.
            verify: check every item's checksum (a checkpoint saved without checksums has none
                to check).
            collective: every rank calls it together, as for `load`.

        Returns:
            `state_dict`'s structure holding its own tensors and arrays (now filled), and the
            checkpoint's values for its other leaves (JSON values, bytes), which cannot be
            filled in place.

        Raises:
            TypeError: `state_dict` is not a dict.
            ValueError: `state_dict` does not match the checkpoint (naming the key).
            CheckpointNotFoundError: nothing committed at `path`.
            CorruptCheckpointError: a bad manifest, a short file or a checksum mismatch,
                naming file, key and offset; tensors may be partly overwritten.
            PeerError: (`collective`) another rank's load failed.

        Cancellation: reads in flight finish; the tensors may be partly filled.
        Concurrency: on a local path, no `keep_last` pruning (of any process) deletes the
        checkpoint while it loads; on an object store (no lease) a checkpoint pruned meanwhile
        fails the load clearly, never with wrong bytes.
        Memory: none for contiguous CPU targets; CUDA and strided targets stage through slabs
        under `memory_budget_bytes`.
        """
        self._check_open()
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a dict, found {type(state_dict).__name__}; "
                            "pass the state dict to fill")
        return await self._load(path, verify, lambda loader: loader.into(state_dict),
                                collective=collective)

    async def restore(self, state_dict: Mapping[str, Any], *,
                      step: int | None = None) -> RestoreResult:
        """Restore `state_dict` in place from the engine's tiers: the newest step (or `step`)
        some tier holds whole, each key of this rank's state from the nearest copy that
        covers it and verifies: its node's local tier, else another node's (sent over
        torch.distributed straight into the tensors), else the store. The job may have another
        world size than the one that saved (resharding). Collective: every rank calls it,
        before training resumes (no save to the tiers in flight).

        Returns:
            a `RestoreResult`: the `step` (the same on every rank; None when no tier ever held
            a step: a first start, `state_dict` left as it was), this rank's `source` (the
            farthest tier it read: `"local"`, `"replica"` or `"store"`) and every rank's, the
            restored `state` (`load_into`'s value: the tensors filled in place, the saved
            values of the other leaves), the bytes read from each tier, and the copies
            `skipped`.

        Raises:
            ValueError: the engine has no tiers.
            CheckpointNotFoundError: steps were saved, but none verifies whole on any tier;
                the message names what each tier held.
            StorageError: no local tier could serve and the store did not answer within its
                deadline (whether a step was saved is unknown: never a first start).
            PeerError: another rank failed or is gone. A state that does not match the
                checkpoint (a key or shape) raises its `ValueError` on its rank.

        Cancellation: the tensors may be partly filled; the collectives of the round in
        flight run to their end first.
        """
        self._check_open()
        if self._tiers is None:
            raise ValueError("restore: expected an engine with tiers (Engine(tiers="
                             "asynctron.Tiers(local=...))), found none; use load_into(state, "
                             "path)")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a dict, found {type(state_dict).__name__}; "
                            "pass the state dict to fill")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                 or step < 0):
            raise ValueError(f"step: expected None or an int >= 0, found {step!r}")
        return await self._tiers.restore(state_dict, step=step)

    async def _load(self, path: str | os.PathLike[str], verify: bool,
                    read: Callable[[Loader], Awaitable[dict[str, Any]]], *,
                    collective: bool = False) -> dict[str, Any]:
        """`_read` as one store operation (one clock on an object store), counted as a load in
        flight until it ends; with `collective`, one of every rank's loads together
        (`SharedLoads`)."""
        storage, checkpoint = self._resources.locate(path)
        share = self.config.shares_reads(self._resources.backend_of(path))
        self._num_loads += 1
        self._loads_done.clear()
        try:
            with store_operation("load", os.fspath(path)):
                if not collective:
                    return await self._read(storage, checkpoint, verify, read, None, None)
                return await self._read_together(storage, checkpoint, verify, read,
                                                 sharing=share)
        finally:
            self._num_loads -= 1
            if not self._num_loads:
                self._loads_done.set()

    async def _read_together(self, storage: CheckpointStorage, checkpoint: str, verify: bool,
                             read: Callable[[Loader], Awaitable[dict[str, Any]]], *,
                             sharing: bool) -> dict[str, Any]:
        """`_read` with the checkpoint found once for every rank, its items read once per job
        (with `sharing`), and every rank's outcome learned by all at the end."""
        shared = self._shared_loads
        assert shared is not None
        seq = shared.next_seq()
        error: BaseException | None = None
        share = shared.share(seq, self.run_blocking) if sharing else None
        async with shared.turn(seq):
            try:
                result = await self._read(storage, checkpoint, verify, read, shared.locate,
                                          share)
            except BaseException as failure:  # told to every rank before it is raised
                error = failure
                if share is not None:
                    await share.abandon(failure)
            await shared.finish(error)
        if error is not None:
            raise error
        return result

    async def _read(self, storage: CheckpointStorage, checkpoint: str, verify: bool,
                    read: Callable[[Loader], Awaitable[dict[str, Any]]],
                    locate: Callable[[Callable[[], Awaitable[Located]]], Awaitable[Located]]
                    | None, share: ReadShare | None) -> dict[str, Any]:
        """Lease the checkpoint, open its reader, `read` it; close and release on every path.
        With `locate`, rank 0's reader finds the checkpoint and the other ranks adopt it; with
        `share`, the ranks read each item once between them."""
        readers: list[CheckpointReader] = []
        max_files = self.config.num_workers

        async def find() -> Located:
            reader = await storage.open_reader(checkpoint, max_files_at_once=max_files)
            readers.append(reader)
            manifest = await reader.open()
            return Located(reader.path, manifest)

        try:
            located = await (find() if locate is None else locate(find))
            shard = located.manifest.shard
            if shard is not None:
                raise ValueError(
                    f"checkpoint {located.path}: expected a whole checkpoint, found rank "
                    f"{shard.rank}'s shard of a step saved to tiers by {shard.world_size} "
                    "ranks; restore it with Engine(tiers=...).restore(state), or load the "
                    "store's checkpoint of that step")
            if not readers:  # found by rank 0: read it as it found it
                reader = await storage.open_reader(located.path, max_files_at_once=max_files)
                readers.append(reader)
                reader.adopt(located.path, located.manifest)
            return await read(self._loads.loader(readers[0], located.manifest,
                                                 verify=verify, share=share))
        finally:
            for reader in readers:
                await reader.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._loop else "not started")
        return f"<Engine {state}, {len(self._saves)} saves in flight, {self.budget!r}>"
