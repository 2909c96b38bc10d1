"""Peers of asynctron's save benchmark, run in one process with it.

Every ``save_*`` function takes a flat or nested state dict of CPU tensors
(``{"a": t, "b": {"c": t2}}``) and a target path, performs the peer's *full durable save*
(the data files are fsync'ed wherever the peer itself does it; none of the peers fsyncs the
parent directory, so neither do these functions) and returns ``None`` once the checkpoint
is complete on storage. Timing is the caller's job: wrap the call in ``time.perf_counter``.
The physical baselines they are compared with live in `asynctron/bench/_baselines.py`.

Peers:

* :func:`save_torch` - ``torch.save`` to one file, then fsync.
* :func:`save_dcp` / :func:`load_dcp` - stock ``torch.distributed.checkpoint`` with
  ``FileSystemWriter(thread_count=N, sync_files=True)``. No process group is needed:
  torch 2.13 treats an uninitialised ``torch.distributed`` as ``no_dist=True`` (one
  process, no collectives); these functions pass ``no_dist=True`` explicitly so they also
  stay single-process after :func:`save_megatron_async` has created its one-rank group.
* :func:`save_dcp_async` - ``torch.distributed.checkpoint.async_save`` with the default
  ``AsyncCheckpointerType.THREAD``, which works without a process group. Its blocking
  part is ``FileSystemWriter.stage`` (a full copy of the state dict into fresh CPU
  memory); the write then runs on a background thread. ``AsyncCheckpointerType.PROCESS``
  is not offered: in torch 2.13 it reads the rank of the default process group
  (``_ProcessGroupInitInfo``) and fails with "Default process group has not been
  initialized" without one.
* :func:`save_safetensors` - ``safetensors.torch.save_file`` then fsync. safetensors
  refuses nested dicts, non-contiguous tensors and tensors whose bytes overlap; the
  function flattens keys with ``"."``, calls ``.contiguous()`` only on non-contiguous
  tensors and clones only tensors overlapping an earlier one, and logs the bytes it copied.
  Those copies are part of the timed save, as they would be for a user.
* :func:`save_megatron_async` - Megatron-core's ``FileSystemWriterAsync``, driven as
  ``TorchDistSaveShardedStrategy.async_save`` + ``TemporalAsyncCaller`` drive it, on CPU.
  Optional: :func:`megatron_available` says whether megatron-core imports and why not.
  megatron-core 0.16.1 installs with ``pip install --no-deps --target /tmp/mcore-site
  megatron-core`` and needs nothing else beyond this venv (torch, numpy, packaging, psutil;
  setuptools through ``torch.utils.cpp_extension``).

The torch.distributed "assuming the intent is to save/load in a single process" warning
is silenced for this module's no-dist calls (a module-level warnings filter) because the
benchmark makes those calls on purpose.

Megatron's writer reports results through a ``multiprocessing`` Manager queue that it
starts with the *spawn* method, which re-imports the caller's ``__main__`` module: the
script that calls :func:`save_megatron_async` must keep its work under
``if __name__ == "__main__":``. The first call also pays for that Manager and for the
one-rank gloo group; benchmark after a warm-up call.

Run ``python -m asynctron.bench._peers_check`` for a self-check that runs every function on
~64 MiB.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import multiprocessing
import os
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.utils import _get_failure_dict

from asynctron.bench._baselines import (
    StateDict,
    flatten_state_dict,
    fsync_path,
)

logger = logging.getLogger(__name__)


MCORE_SITE_ENV = "ASYNCTRON_MCORE_SITE"
DEFAULT_MCORE_SITE = "/tmp/mcore-site"
_MCORE_MODULES = (
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
)


warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)



# --------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------


def save_torch(state_dict: StateDict, path: str) -> None:
    """``torch.save`` to ``path`` (its C++ zip writer, one file), then fsync the file."""
    torch.save(state_dict, path)
    fsync_path(path)


def save_dcp(state_dict: StateDict, directory: str, thread_count: int) -> None:
    """Stock ``torch.distributed.checkpoint.save``, single process, no process group.

    ``FileSystemWriter(thread_count=N, sync_files=True)`` writes N ``__0_<i>.distcp``
    files from N threads (fsync'ing each), then ``.metadata`` (fsync'ed, then renamed).
    """
    writer = dcp.FileSystemWriter(directory, thread_count=thread_count, sync_files=True)
    dcp.save(state_dict, storage_writer=writer, no_dist=True)


def load_dcp(state_dict_template: StateDict, directory: str) -> None:
    """Load a DCP (or Megatron ``FileSystemWriterAsync``) checkpoint into the template in place.

    The template must have the saved keys (nested as saved; flat for Megatron checkpoints,
    whose keys were flattened at save time), shapes and dtypes.
    """
    reader = dcp.FileSystemReader(directory)
    dcp.load(state_dict_template, storage_reader=reader, no_dist=True)


def save_dcp_async(
    state_dict: StateDict,
    directory: str,
    thread_count: int,
    *,
    on_staged: Callable[[], None] | None = None,
) -> None:
    """``torch.distributed.checkpoint.async_save`` (thread executor), waited to completion.

    The blocking part (what training would wait for) is the stage: a full copy of the state
    dict into new CPU memory. ``on_staged`` is called as soon as ``async_save`` returns, so
    the caller can time that part; the function returns when the background save (same
    writer as :func:`save_dcp`) has finished and fsync'ed.
    """
    writer = dcp.FileSystemWriter(directory, thread_count=thread_count, sync_files=True)
    future = dcp.async_save(state_dict, storage_writer=writer, no_dist=True)
    if not isinstance(future, Future):
        raise TypeError(
            f"save_dcp_async: async_save returned {type(future).__name__}, expected a Future"
        )
    if on_staged is not None:
        on_staged()
    future.result()


@functools.cache
def default_stager_is_reusable() -> bool:
    """Whether this torch's `DefaultStager` stages more than once. torch 2.11 and 2.12 close
    its state-dict stager after every stage (dropping the cached staging memory; the next
    stage fails with KeyError), so a trainer there makes one per save: the peers do too."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        stager.close()
    return True


class OneStagerPerSave:
    """The `DefaultStager` a DCP peer hands `async_save`: one kept across saves (its best
    settings, warm staging memory), or, where this torch's cannot stage twice
    (`default_stager_is_reusable`), a fresh one per save."""

    def __init__(self, options: Any) -> None:
        self.options = options
        self.kept = default_stager_is_reusable()
        self._stager: Any = None

    def for_save(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager

        if self._stager is None or not self.kept:
            self.close()
            self._stager = DefaultStager(self.options)
        return self._stager

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


class DcpAsyncSaver:
    """``dcp.async_save``, kept across saves as a trainer keeps it.

    With ``persistent_stager`` (its best settings) one ``DefaultStager`` caches its staging
    copy of every storage, so from the second save on the blocking copy goes into warm memory;
    without it (DCP's default, what a trainer gets from ``async_save(sd, checkpoint_id=...)``)
    every call stages into fresh memory. ``FileSystemWriter(thread_count, sync_files=True)``
    writes. ``process=True`` is ``AsyncCheckpointerType.PROCESS``: the stager puts the staged
    state in shared memory and a persistent background process writes it; that mode needs a
    process group, so a one-rank gloo group is created.
    """

    def __init__(self, *, process: bool, thread_count: int = 4,
                 persistent_stager: bool = True) -> None:
        from torch.distributed.checkpoint.staging import StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.thread_count = thread_count
        self._type = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        if process:
            _ensure_single_rank_process_group()
            # The writer process logs every request at INFO on the root logger.
            logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
        self._stagers = OneStagerPerSave(StagingOptions(
            use_pinned_memory=False, use_shared_memory=process, use_async_staging=False,
            use_non_blocking_copy=False)) if persistent_stager else None
        self._no_dist = not process

    def start(self, state_dict: StateDict, directory: str) -> Future:
        """Stage (the blocking part) and start the write; the future completes once durable."""
        writer = dcp.FileSystemWriter(directory, thread_count=self.thread_count, sync_files=True)
        stager = self._stagers.for_save() if self._stagers is not None else None
        future = dcp.async_save(state_dict, storage_writer=writer, async_stager=stager,
                                async_checkpointer_type=self._type, no_dist=self._no_dist)
        if not isinstance(future, Future):
            raise TypeError(f"DcpAsyncSaver: async_save returned {type(future).__name__}, "
                            "expected a Future")
        return future

    def close(self) -> None:
        if self._stagers is not None:
            self._stagers.close()


def _safetensors_ready(state_dict: StateDict) -> dict[str, torch.Tensor]:
    """Flatten keys and copy exactly the tensors safetensors would reject.

    Non-contiguous tensors get ``.contiguous()``; of tensors whose bytes overlap (same
    storage), the first in address order is kept and later ones are cloned.
    """
    flat = flatten_state_dict(state_dict)
    copied = 0
    for name, tensor in flat.items():
        if not tensor.is_contiguous():
            flat[name] = tensor.contiguous()
            copied += tensor.nbytes
    by_storage: dict[int, list[tuple[int, int, str]]] = {}
    for name, tensor in flat.items():
        if tensor.nbytes:
            start = tensor.data_ptr()
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(
                (start, start + tensor.nbytes, name)
            )
    for areas in by_storage.values():
        areas.sort()
        last_stop = 0
        for start, stop, name in areas:
            if start < last_stop:
                flat[name] = flat[name].clone()
                copied += flat[name].nbytes
            else:
                last_stop = stop
    if copied:
        logger.info("save_safetensors: copied %d bytes to satisfy safetensors", copied)
    return flat


def save_safetensors(state_dict: StateDict, path: str) -> None:
    """``safetensors.torch.save_file`` (one file, zero-copy from tensor memory), then fsync.

    Nested keys are flattened with ``"."``; non-contiguous or overlapping tensors are copied
    first (see the module docstring), and that copy is part of the measured save.
    """
    safetensors.torch.save_file(_safetensors_ready(state_dict), path)
    fsync_path(path)


@functools.cache
def megatron_available() -> str | None:
    """``None`` if Megatron-core's async writer imports, else the reason it does not.

    megatron-core is looked for on ``sys.path``, with ``$ASYNCTRON_MCORE_SITE`` (if set) or
    else ``/tmp/mcore-site`` (if it exists) appended to it first.
    """
    site = os.environ.get(MCORE_SITE_ENV)
    if site is not None and not os.path.isdir(site):
        return f"{MCORE_SITE_ENV}={site} is not a directory"
    site = site or DEFAULT_MCORE_SITE
    if os.path.isdir(site) and site not in sys.path:
        sys.path.append(site)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            for module in _MCORE_MODULES:
                importlib.import_module(module)
    except Exception as exc:
        return (
            f"megatron-core is not importable ({type(exc).__name__}: {exc}); install it "
            f"with 'pip install --no-deps --target {site} megatron-core' or set "
            f"{MCORE_SITE_ENV}"
        )
    return None


def _ensure_single_rank_process_group() -> None:
    """Create a one-rank gloo group if none exists; Megatron's writer needs ``get_rank()``.

    The store is an in-process ``HashStore`` (no TCP rendezvous) and gloo is pinned to the
    loopback interface unless ``GLOO_SOCKET_IFNAME`` is already set. The group is kept for
    later calls; an existing group must have world size 1.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(
                "save_megatron_async: torch.distributed is initialised with world size "
                f"{dist.get_world_size()}; this benchmark peer needs a single rank"
            )
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def save_megatron_async(
    state_dict: StateDict,
    directory: str,
    *,
    thread_count: int = 2,
    on_staged: Callable[[], None] | None = None,
) -> None:
    """Megatron-core ``FileSystemWriterAsync`` save, waited to completion, on one CPU process:
    :func:`start_megatron_async`, ``on_staged()``, then its ``finish()``."""
    save = start_megatron_async(state_dict, directory, thread_count=thread_count)
    if on_staged is not None:
        on_staged()
    save.finish()


class MegatronSave:
    """A Megatron async save in flight: its writer process, and what finalizing needs."""

    def __init__(self, writer: Any, metadata: Any, dist_wrapper: Any,
                 process: multiprocessing.process.BaseProcess | None, directory: str) -> None:
        self._writer = writer
        self._metadata = metadata
        self._dist_wrapper = dist_wrapper
        self._process = process
        self._directory = directory

    def done(self) -> bool:
        return self._process is None or not self._process.is_alive()

    def finish(self) -> None:
        """Wait for the writer process, then finalize (gather results, write ``.metadata``)."""
        if self._process is not None:
            self._process.join()
            if self._process.exitcode != 0:
                raise RuntimeError(
                    f"save_megatron_async: writer process for {self._directory} exited with "
                    f"code {self._process.exitcode}"
                )
        all_results = self._dist_wrapper.gather_object(self._writer.retrieve_write_results())
        failures = _get_failure_dict(all_results)
        if failures:
            raise dcp.CheckpointException("write", failures)
        self._writer.finish(self._metadata, all_results)


def start_megatron_async(
    state_dict: StateDict, directory: str, *, thread_count: int = 2
) -> MegatronSave:
    """Start a Megatron-core ``FileSystemWriterAsync`` save on one CPU process; returns once
    training could go on (after the fork), with a handle whose ``finish()`` completes it.

    Replicates ``TorchDistSaveShardedStrategy.async_save`` (thread_count 2 is its default):
    ``save_state_dict_async_plan`` with ``MCoreSavePlanner`` (decentralised plan) on the
    flattened state dict; ``preload_tensors`` (no copy for CPU tensors); a *forked* process
    running ``write_preloaded_data_multiproc``, which forks ``thread_count`` writers that
    write and fsync one ``__0_<i>.distcp`` file each (fork copy-on-write is the snapshot);
    then ``save_state_dict_async_finalize``'s work in ``finish()``: gather the write results,
    fail on any worker error, and ``finish`` (``.metadata`` fsync'ed and renamed). The result
    loads with :func:`load_dcp` given a flat template.

    Megatron's own ``TemporalAsyncCaller``/``AsyncRequest`` and the finalize function cannot
    run here: they call ``torch.cuda.synchronize()`` / ``torch.cuda.current_device()``,
    which raise on a CPU-only torch; so do ``preload_tensors(non_blocking=True)``'s sync,
    hence ``non_blocking=False``. Needs a one-rank gloo group (created on first use).
    """
    reason = megatron_available()
    if reason is not None:
        raise RuntimeError(f"save_megatron_async: {reason}")
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_plan,
    )
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    _ensure_single_rank_process_group()
    writer = FileSystemWriterAsync(directory, thread_count=thread_count)
    planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
    (writer, metadata, dist_wrapper), *_cached_plans = save_state_dict_async_plan(
        flatten_state_dict(state_dict), writer, None, 0, planner=planner
    )
    save_fn, _preload_fn, save_args = writer.get_save_function_and_args()
    process = None
    if save_fn is not None:
        save_args[1] = FileSystemWriterAsync.preload_tensors(save_args[1], non_blocking=False)
        process = multiprocessing.get_context("fork").Process(
            target=save_fn, args=tuple(save_args), name="megatron-async-writer"
        )
        process.start()
    return MegatronSave(writer, metadata, dist_wrapper, process, directory)


def peer_versions() -> dict[str, str]:
    """Versions of torch, numpy, safetensors and (when importable) megatron-core."""
    names = ["torch", "numpy", "safetensors"]
    if megatron_available() is None:
        names.append("megatron-core")
    return {name: importlib.metadata.version(name) for name in names}
