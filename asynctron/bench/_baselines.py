"""Physical baselines for asynctron's benchmarks, and the state dicts they measure.

Physical baselines (what the hardware can do, with no checkpoint format on top):

* :func:`raw_pwrite_fsync` - one thread, one file, large ``pwritev`` calls, ``fsync``.
* :func:`raw_memcpy` - one thread copying into pre-faulted destinations (staging bound).
* :func:`raw_read` - one thread, large ``preadv`` calls into preallocated buffers;
  :func:`evict_page_cache` makes the next read cold (a no-op on tmpfs such as /dev/shm,
  where the page cache *is* the storage).

On this VM, memory the guest has never touched is slow to touch the first time (writing
fresh tmpfs or anonymous pages ran at ~0.35-0.45 GB/s, against ~2.4 GB/s once pages had
been used and freed), so whichever function runs first in a process can look slow: warm
up (or alternate the order of) the functions before comparing them.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeAlias

import numpy as np
import torch
import xxhash

logger = logging.getLogger(__name__)

StateDict: TypeAlias = Mapping[str, "torch.Tensor | StateDict"]
Buffer: TypeAlias = memoryview | np.ndarray

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
DEFAULT_CALL_BYTES = 64 * MIB


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_IOV_MAX = os.sysconf("SC_IOV_MAX")
# Every generated tensor is a multiple of this, so it can be filled through an int64 view.
_TENSOR_ALIGN = 256
# Clearing the top exponent bit of every element keeps random bit patterns finite (|x| < 2).
_FINITE_MASKS = {
    torch.float32: 0xBFFFFFFF_BFFFFFFF - (1 << 64),
    torch.bfloat16: 0xBFFF_BFFF_BFFF_BFFF - (1 << 64),
}




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


def _transfer_all(call: Callable[[int, list[memoryview], int], int], fd: int,
                  views: Sequence[memoryview], call_bytes: int, what: str) -> None:
    """Move every byte of `views` with `os.pwritev`/`os.preadv` calls of about `call_bytes`
    each, from offset 0, looping over short transfers."""
    offset = 0
    for batch in _batches(views, call_bytes):
        remaining = batch
        left = sum(len(view) for view in batch)
        while left:
            done = call(fd, remaining, offset)
            if done <= 0:
                raise OSError(f"{what}: stopped at offset {offset}")
            offset += done
            left -= done
            remaining = _advance(remaining, done)


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
        _transfer_all(os.pwritev, fd, views, call_bytes, f"raw_pwrite_fsync: writing {path}")
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
    import psutil  # the `bench` extra

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
    import crc32c  # the `bench` extra

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
            _transfer_all(os.preadv, fd, [view[:size]], call_bytes,
                          f"raw_read: reading {path} ({size} bytes)")
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


def fsync_path(path: str) -> None:
    """fsync one file (as the peers do after writing it)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
