"""Peers and physical baselines for asynctron's save benchmark, run in one process.

Every ``save_*`` function takes a flat or nested state dict of CPU tensors
(``{"a": t, "b": {"c": t2}}``) and a target path, performs the peer's *full durable save*
(the data files are fsync'ed wherever the peer itself does it; none of the peers fsyncs the
parent directory, so neither do these functions) and returns ``None`` once the checkpoint
is complete on storage. Timing is the caller's job: wrap the call in ``time.perf_counter``.

Physical baselines (what the hardware can do, with no checkpoint format on top):

* :func:`raw_pwrite_fsync` - one thread, one file, large ``pwritev`` calls, ``fsync``.
* :func:`raw_memcpy` - one thread copying into pre-faulted destinations (staging bound).
* :func:`raw_read` - one thread, large ``preadv`` calls into preallocated buffers;
  :func:`evict_page_cache` makes the next read cold (a no-op on tmpfs such as /dev/shm,
  where the page cache *is* the storage).

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

On this VM, memory the guest has never touched is slow to touch the first time (writing
fresh tmpfs or anonymous pages ran at ~0.35-0.45 GB/s, against ~2.4 GB/s once pages had
been used and freed), so whichever function runs first in a process can look slow: warm
up (or alternate the order of) the functions before comparing them.

Run ``python bench/_peers.py`` for a self-check that runs every function on ~64 MiB.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import importlib
import importlib.metadata
import logging
import mmap
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TypeAlias

import crc32c
import numpy as np
import psutil
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.utils import _get_failure_dict

logger = logging.getLogger(__name__)

StateDict: TypeAlias = Mapping[str, "torch.Tensor | StateDict"]
Buffer: TypeAlias = memoryview | np.ndarray

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
DEFAULT_CALL_BYTES = 64 * MIB

MCORE_SITE_ENV = "ASYNCTRON_MCORE_SITE"
DEFAULT_MCORE_SITE = "/tmp/mcore-site"
_MCORE_MODULES = (
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
)

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_IOV_MAX = os.sysconf("SC_IOV_MAX")
# Every generated tensor is a multiple of this, so it can be filled through an int64 view.
_TENSOR_ALIGN = 256
# Clearing the top exponent bit of every element keeps random bit patterns finite (|x| < 2).
_FINITE_MASKS = {
    torch.float32: 0xBFFFFFFF_BFFFFFFF - (1 << 64),
    torch.bfloat16: 0xBFFF_BFFF_BFFF_BFFF - (1 << 64),
}

warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)


# --------------------------------------------------------------------------------------
# State dicts
# --------------------------------------------------------------------------------------


def make_state_dict(
    total_bytes: int, *, seed: int = 0, large_tensor_bytes: int | None = None
) -> dict[str, torch.Tensor]:
    """Build a deterministic, transformer-like flat state dict of ``total_bytes`` bytes.

    Layers hold a norm and four weight/bias pairs: weights of 4..64 MiB, norms and biases of
    4 KiB..1 MiB (log-uniform sizes), each tensor float32 or bfloat16 at random. Past
    512 MiB, two larger "embedding"/"output" tensors (a tenth of the budget each, 96 MiB to
    1 GiB) are added; ``large_tensor_bytes`` adds one ``large.weight`` tensor of that size.
    The sum is ``total_bytes`` rounded down to 256 bytes. Values are random bit patterns
    with the top exponent bit cleared: finite (|x| < 2, so ``torch.equal`` round-trips) and
    incompressible. The same ``seed`` gives the same names, shapes, dtypes and bytes.
    """
    if total_bytes < _TENSOR_ALIGN:
        raise ValueError(f"make_state_dict: total_bytes={total_bytes} is below {_TENSOR_ALIGN}")
    if large_tensor_bytes is not None and not 0 < large_tensor_bytes <= total_bytes:
        raise ValueError(
            f"make_state_dict: large_tensor_bytes={large_tensor_bytes} must be in "
            f"(0, total_bytes={total_bytes}]"
        )
    rng = random.Random(seed)
    sizes: list[tuple[str, int]] = []
    remaining = total_bytes - total_bytes % _TENSOR_ALIGN

    def take(name: str, nbytes: int) -> None:
        nonlocal remaining
        nbytes = min(nbytes - nbytes % _TENSOR_ALIGN, remaining)
        if nbytes > 0:
            sizes.append((name, nbytes))
            remaining -= nbytes

    def log_uniform(low: int, high: int) -> int:
        return int(2 ** rng.uniform(low.bit_length() - 1, high.bit_length() - 1))

    if large_tensor_bytes is not None:
        take("large.weight", max(large_tensor_bytes, _TENSOR_ALIGN))
    if remaining >= 512 * MIB:
        extra = min(max(remaining // 10, 96 * MIB), GIB)
        take("embedding.weight", extra)
        take("output.weight", extra)
    layer = 0
    while remaining:
        prefix = f"layers.{layer}."
        take(prefix + "norm.weight", log_uniform(4 * KIB, MIB))
        for proj in ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2"):
            take(f"{prefix}{proj}.weight", log_uniform(4 * MIB, 64 * MIB))
            take(f"{prefix}{proj}.bias", log_uniform(4 * KIB, MIB))
        layer += 1

    generator = torch.Generator().manual_seed(seed)
    state_dict: dict[str, torch.Tensor] = {}
    for name, nbytes in sizes:
        dtype = rng.choice((torch.float32, torch.bfloat16))
        state_dict[name] = _random_tensor(nbytes, dtype, generator, matrix=name.endswith("weight"))
    return state_dict


def _random_tensor(
    nbytes: int, dtype: torch.dtype, generator: torch.Generator, *, matrix: bool
) -> torch.Tensor:
    """A tensor of ``nbytes`` finite random values, 2-D (…, 256..4096 columns) if ``matrix``."""
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    tensor = torch.empty(numel, dtype=dtype)
    bits = tensor.view(torch.int64)
    bits.random_(-(2**63), 2**63 - 1, generator=generator)
    bits.bitwise_and_(_FINITE_MASKS[dtype])
    if matrix and numel > 4096:
        columns = next(c for c in (4096, 2048, 1024, 512, 256, 128, 64) if numel % c == 0)
        return tensor.view(numel // columns, columns)
    return tensor


def flatten_state_dict(state_dict: StateDict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten nested mappings into ``{"a.b.c": tensor}`` (no copies), rejecting non-tensors."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"flatten_state_dict: key {key!r} under {prefix!r} is not a str")
        name = f"{prefix}{key}"
        items = (
            flatten_state_dict(value, f"{name}.").items()
            if isinstance(value, Mapping)
            else [(name, value)]
        )
        for flat_name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"flatten_state_dict: {flat_name!r} is a {type(tensor).__name__}, "
                    "not a torch.Tensor"
                )
            if flat_name in flat:
                raise ValueError(f"flatten_state_dict: key {flat_name!r} appears twice")
            flat[flat_name] = tensor
    return flat


def state_dict_buffers(state_dict: StateDict) -> list[np.ndarray]:
    """Zero-copy uint8 numpy views of every tensor's bytes, in flattened key order.

    These feed the physical baselines with the same bytes the peers save. A non-contiguous
    tensor is copied with ``.contiguous()`` first (logged); tensors sharing storage are
    returned once per key, so shared bytes count (and get written) once per key.
    """
    buffers: list[np.ndarray] = []
    copied = 0
    for name, tensor in flatten_state_dict(state_dict).items():
        if tensor.device.type != "cpu":
            raise ValueError(f"state_dict_buffers: {name!r} is on {tensor.device}, not the CPU")
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
            copied += tensor.nbytes
        buffers.append(tensor.reshape(-1).view(torch.uint8).numpy())
    if copied:
        logger.info("state_dict_buffers: copied %d bytes of non-contiguous tensors", copied)
    return buffers


# --------------------------------------------------------------------------------------
# Physical baselines
# --------------------------------------------------------------------------------------


def _byte_view(buffer: Buffer, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte memoryview of a C-contiguous buffer."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    if writable and view.readonly:
        raise ValueError("buffer is read-only")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _batches(views: Sequence[memoryview], call_bytes: int) -> Iterator[list[memoryview]]:
    """Regroup byte views into iovec lists of exactly ``call_bytes`` (the last may be short)."""
    if call_bytes <= 0:
        raise ValueError(f"call_bytes must be positive, got {call_bytes}")
    batch: list[memoryview] = []
    batch_bytes = 0
    for view in views:
        pos = 0
        while pos < len(view):
            step = min(len(view) - pos, call_bytes - batch_bytes)
            batch.append(view[pos : pos + step])
            batch_bytes += step
            pos += step
            if batch_bytes == call_bytes or len(batch) == _IOV_MAX:
                yield batch
                batch, batch_bytes = [], 0
    if batch:
        yield batch


def _advance(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """Drop the first ``nbytes`` bytes from an iovec list (after a short read or write)."""
    while nbytes and nbytes >= len(views[0]):
        nbytes -= len(views[0])
        views = views[1:]
    if nbytes:
        views = [views[0][nbytes:], *views[1:]]
    return views


def raw_pwrite_fsync(
    buffers: Sequence[Buffer], path: str, call_bytes: int = DEFAULT_CALL_BYTES
) -> None:
    """Physical write baseline: one thread writes ``buffers`` back to back into one file.

    Measures disk (or tmpfs) write bandwidth as seen through the page cache plus the final
    ``fsync``: the buffers are gathered into ``pwritev`` calls of ``call_bytes`` each (so
    small tensors do not mean small syscalls), then the file is fsync'ed and closed.
    """
    views = [_byte_view(buffer) for buffer in buffers]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        offset = 0
        for batch in _batches(views, call_bytes):
            remaining = batch
            left = sum(len(view) for view in batch)
            while left:
                written = os.pwritev(fd, remaining, offset)
                if written <= 0:
                    raise OSError(f"raw_pwrite_fsync: pwritev wrote {written} bytes to {path}")
                offset += written
                left -= written
                remaining = _advance(remaining, written)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_direct_pwrite_fsync(nbytes: int, path: str, call_bytes: int = DEFAULT_CALL_BYTES) -> None:
    """Physical ceiling of the storage: one thread writes ``nbytes`` with ``O_DIRECT`` from one
    page-aligned ``call_bytes`` buffer (written again and again; content does not matter to
    the device), then fsyncs. Raises ``OSError(EINVAL)`` where the filesystem refuses
    ``O_DIRECT`` (tmpfs)."""
    buffer = mmap.mmap(-1, call_bytes)
    buffer.write(b"\x5a" * call_bytes)
    view = memoryview(buffer)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT, 0o644)
    try:
        offset = 0
        while offset < nbytes:
            size = min(call_bytes, nbytes - offset)
            if size % _PAGE_BYTES:  # the unaligned tail goes through the page cache
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            written = os.pwrite(fd, view[:size], offset)
            if written <= 0:
                raise OSError(f"raw_direct_pwrite_fsync: pwrite wrote {written} bytes to {path}")
            offset += written
        os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
        buffer.close()


def warm_guest_memory(reserve_bytes: int = 4 * GIB, chunk_bytes: int = GIB) -> int:
    """Touch (then free) all available memory but ``reserve_bytes``; returns the bytes touched.

    On a VM whose host backs guest memory lazily, the first touch of a guest page is several
    times slower than any later one (0.22 GB/s against 10 GB/s on this project's VM), so the
    first method to allocate memory would look slow for reasons that have nothing to do with
    it. Touching the memory once up front gives every method the same, warm, memory.
    """
    target = max(0, psutil.virtual_memory().available - reserve_bytes)
    chunks = []
    for _ in range(target // chunk_bytes):
        chunk = np.empty(chunk_bytes, dtype=np.uint8)
        chunk[::_PAGE_BYTES] = 1
        chunks.append(chunk)
    touched = len(chunks) * chunk_bytes
    del chunks
    return touched


def hash_all(buffers: Sequence[np.ndarray], algorithm: str) -> None:
    """One thread hashes every buffer whole: ``"crc32c"`` or ``"xxh3_64"``."""
    for buffer in buffers:
        view = _byte_view(buffer)
        if algorithm == "crc32c":
            crc32c.crc32c(view)
        else:
            xxhash.xxh3_64_intdigest(view)


def _prefaulted(array: np.ndarray) -> np.ndarray:
    """Write one byte per page so the first real copy takes no page faults."""
    array.reshape(-1).view(np.uint8)[::_PAGE_BYTES] = 0
    return array


def make_memcpy_destinations(sources: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Allocate one array per source (same dtype and shape), every page already touched."""
    return [_prefaulted(np.empty_like(source, order="C")) for source in sources]


def raw_memcpy(sources: Sequence[np.ndarray], destinations: Sequence[np.ndarray]) -> None:
    """Physical staging baseline: one thread ``np.copyto`` of each source into its destination.

    Measures single-core memory bandwidth (read + write), the floor for any snapshot that
    copies the state dict; pass destinations from :func:`make_memcpy_destinations`.
    """
    if len(sources) != len(destinations):
        raise ValueError(f"raw_memcpy: {len(sources)} sources but {len(destinations)} destinations")
    for index, (source, destination) in enumerate(zip(sources, destinations, strict=True)):
        if source.nbytes != destination.nbytes:
            raise ValueError(
                f"raw_memcpy: source {index} has {source.nbytes} bytes, "
                f"destination has {destination.nbytes}"
            )
        np.copyto(destination, source, casting="no")


def make_read_buffers(path_list: Sequence[str]) -> list[np.ndarray]:
    """Allocate one pre-faulted uint8 array per file, sized to the file."""
    return [_prefaulted(np.empty(os.path.getsize(path), dtype=np.uint8)) for path in path_list]


def raw_read(
    path_list: Sequence[str],
    into_buffers: Sequence[Buffer],
    call_bytes: int = DEFAULT_CALL_BYTES,
) -> None:
    """Physical read baseline: one thread reads each whole file into its buffer.

    Uses ``preadv`` calls of ``call_bytes`` each. Measures page-cache copy speed for a hot
    file, or storage read bandwidth after :func:`evict_page_cache`.
    """
    if len(path_list) != len(into_buffers):
        raise ValueError(f"raw_read: {len(path_list)} paths but {len(into_buffers)} buffers")
    for path, buffer in zip(path_list, into_buffers, strict=True):
        view = _byte_view(buffer, writable=True)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if len(view) < size:
                raise ValueError(f"raw_read: {path} has {size} bytes, buffer only {len(view)}")
            offset = 0
            for batch in _batches([view[:size]], call_bytes):
                remaining = batch
                left = sum(len(part) for part in batch)
                while left:
                    got = os.preadv(fd, remaining, offset)
                    if got <= 0:
                        raise OSError(f"raw_read: {path} ended at {offset} of {size} bytes")
                    offset += got
                    left -= got
                    remaining = _advance(remaining, got)
        finally:
            os.close(fd)


def _files_under(paths: Sequence[str]) -> Iterator[str]:
    """The given files, and every file below the given directories."""
    for path in paths:
        if os.path.isdir(path):
            for root, _dirs, files in os.walk(path):
                yield from (os.path.join(root, name) for name in files)
        else:
            yield path


def evict_page_cache(paths: Sequence[str]) -> None:
    """Drop the page cache of files (directories are walked) so the next read is cold.

    Each file is fsync'ed first (dirty pages cannot be dropped), then
    ``posix_fadvise(POSIX_FADV_DONTNEED)``. Best effort: pages mapped by a process stay,
    and on tmpfs (/dev/shm) nothing can be evicted because memory is the storage.
    """
    for path in _files_under(paths):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_torch(state_dict: StateDict, path: str) -> None:
    """``torch.save`` to ``path`` (its C++ zip writer, one file), then fsync the file."""
    torch.save(state_dict, path)
    _fsync_path(path)


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
    _fsync_path(path)


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
    """Megatron-core ``FileSystemWriterAsync`` save, waited to completion, on one CPU process.

    Replicates ``TorchDistSaveShardedStrategy.async_save`` (thread_count 2 is its default):
    ``save_state_dict_async_plan`` with ``MCoreSavePlanner`` (decentralised plan) on the
    flattened state dict; ``preload_tensors`` (no copy for CPU tensors); a *forked* process
    running ``write_preloaded_data_multiproc``, which forks ``thread_count`` writers that
    write and fsync one ``__0_<i>.distcp`` file each (fork copy-on-write is the snapshot);
    then ``save_state_dict_async_finalize``'s work: gather the write results, fail on any
    worker error, and ``finish`` (``.metadata`` fsync'ed and renamed). The result loads with
    :func:`load_dcp` given a flat template. ``on_staged`` is called right after the fork,
    where Megatron returns control to training.

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
    if on_staged is not None:
        on_staged()
    if process is not None:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(
                f"save_megatron_async: writer process for {directory} exited with "
                f"code {process.exitcode}"
            )
    all_results = dist_wrapper.gather_object(writer.retrieve_write_results())
    failures = _get_failure_dict(all_results)
    if failures:
        raise dcp.CheckpointException("write", failures)
    writer.finish(metadata, all_results)


def peer_versions() -> dict[str, str]:
    """Versions of torch, numpy, safetensors and (when importable) megatron-core."""
    names = ["torch", "numpy", "safetensors"]
    if megatron_available() is None:
        names.append("megatron-core")
    return {name: importlib.metadata.version(name) for name in names}


# --------------------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------------------


def _assert_equal(expected: StateDict, actual: StateDict, label: str) -> None:
    want, got = flatten_state_dict(expected), flatten_state_dict(actual)
    if want.keys() != got.keys():
        raise AssertionError(f"{label}: keys differ: {sorted(want.keys() ^ got.keys())[:5]}")
    bad = [name for name in want if not torch.equal(want[name], got[name])]
    if bad:
        raise AssertionError(f"{label}: tensors differ after the round trip: {bad[:5]}")


def _self_check(base: str, total_mib: int) -> None:
    """Run every function on a ~``total_mib`` MiB state dict, verify and print timings."""
    started = time.perf_counter()
    state_dict = make_state_dict(total_mib * MIB, seed=0, large_tensor_bytes=total_mib * MIB // 4)
    buffers = state_dict_buffers(state_dict)
    nbytes = sum(buffer.nbytes for buffer in buffers)
    print(
        f"state dict: {len(state_dict)} tensors, {nbytes / MIB:.1f} MiB, "
        f"built in {time.perf_counter() - started:.2f} s; versions {peer_versions()}"
    )
    print(f"{'function':<22}{'1st ms':>10}{'2nd ms':>10}{'2nd GB/s':>10}")

    def report(label: str, seconds: list[float]) -> None:
        print(
            f"{label:<22}{seconds[0] * 1e3:>10.1f}{seconds[1] * 1e3:>10.1f}"
            f"{nbytes / seconds[1] / 1e9:>10.2f}"
        )

    def timed_twice(label: str, run: Callable[[str], None], suffix: str = "") -> str:
        """Run ``run(target)`` on two fresh targets; return the second target."""
        seconds = []
        for attempt in (1, 2):
            target = os.path.join(base, f"{label}-{attempt}{suffix}")
            begin = time.perf_counter()
            run(target)
            seconds.append(time.perf_counter() - begin)
        report(label, seconds)
        return target

    flat_path = timed_twice("raw_pwrite_fsync", lambda t: raw_pwrite_fsync(buffers, t), ".bin")
    evict_page_cache([flat_path])
    read_buffers = make_read_buffers([flat_path])
    read_seconds = []
    for _attempt in (1, 2):
        begin = time.perf_counter()
        raw_read([flat_path], read_buffers)
        read_seconds.append(time.perf_counter() - begin)
    report("raw_read", read_seconds)
    if not np.array_equal(read_buffers[0], np.concatenate(buffers)):
        raise AssertionError("raw_pwrite_fsync/raw_read: file bytes differ from the buffers")

    destinations = make_memcpy_destinations(buffers)
    copy_seconds = []
    for _attempt in (1, 2):
        begin = time.perf_counter()
        raw_memcpy(buffers, destinations)
        copy_seconds.append(time.perf_counter() - begin)
    report("raw_memcpy", copy_seconds)
    if not all(map(np.array_equal, buffers, destinations)):
        raise AssertionError("raw_memcpy: destinations differ from the sources")

    path = timed_twice("save_torch", lambda t: save_torch(state_dict, t), ".pt")
    _assert_equal(state_dict, torch.load(path, weights_only=True), "save_torch")

    def template() -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(tensor) for name, tensor in state_dict.items()}

    for label, run in (
        ("save_dcp", lambda t: save_dcp(state_dict, t, thread_count=2)),
        ("save_dcp_async", lambda t: save_dcp_async(state_dict, t, thread_count=2)),
    ):
        directory = timed_twice(label, run)
        loaded = template()
        load_dcp(loaded, directory)
        _assert_equal(state_dict, loaded, label)

    path = timed_twice("save_safetensors", lambda t: save_safetensors(state_dict, t), ".st")
    _assert_equal(state_dict, safetensors.torch.load_file(path), "save_safetensors")
    weight = next(t for t in state_dict.values() if t.dim() == 2)
    awkward = {"nested": {"w": weight, "w_t": weight.t(), "tied": weight}}
    awkward_path = os.path.join(base, "awkward.st")
    save_safetensors(awkward, awkward_path)
    _assert_equal(awkward, safetensors.torch.load_file(awkward_path), "save_safetensors nested")

    reason = megatron_available()
    if reason is None:
        directory = timed_twice("save_megatron_async", lambda t: save_megatron_async(state_dict, t))
        loaded = template()
        load_dcp(loaded, directory)
        _assert_equal(state_dict, loaded, "save_megatron_async")
    else:
        print(f"save_megatron_async: skipped: {reason}")

    async_runs: list[tuple[str, Callable[[str, Callable[[], None]], None]]] = [
        ("save_dcp_async", lambda t, cb: save_dcp_async(state_dict, t, 2, on_staged=cb)),
    ]
    if reason is None:
        async_runs.append(
            ("save_megatron_async", lambda t, cb: save_megatron_async(state_dict, t, on_staged=cb))
        )
    staged_at: list[float] = []

    def mark_staged() -> None:
        staged_at.append(time.perf_counter())

    for label, run in async_runs:
        staged_at.clear()
        begin = time.perf_counter()
        run(os.path.join(base, f"{label}-staged"), mark_staged)
        total = time.perf_counter() - begin
        print(f"{label}: blocking {(staged_at[0] - begin) * 1e3:.1f} ms of {total * 1e3:.1f} ms")
    evict_page_cache([base])
    print("all peers round-tripped")


def main() -> None:
    """Command line for the self-check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where to make the scratch directory (default /dev/shm)",
    )
    parser.add_argument("--mib", type=int, default=64, help="state dict size in MiB")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    base = tempfile.mkdtemp(prefix="asynctron-peers-", dir=args.dir)
    try:
        _self_check(base, args.mib)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
