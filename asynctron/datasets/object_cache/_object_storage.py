"""Datasets on object storage: megatron-core's `ObjectStorageConfig`, and the node-local cache.

A dataset at `s3://bucket/prefix/name` keeps, under the config's cache directory (megatron's
`path_to_idx_cache`), beside the object's key as megatron lays it out:
- `bucket/prefix/name.idx`: the whole `.idx`, fetched once per node (one process fetches, the
  others wait on a lock), published atomically, and recorded with the object's ETag, size and
  xxh3 digest (`.idx.source`): a cached copy that is truncated, corrupt or of another version
  of the object is fetched again;
- `bucket/prefix/name.bin`: the `.bin` ranges read so far (`RangeCache`), within the byte
  budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from asynctron.storage.backends import backend_for, is_remote_path

if TYPE_CHECKING:
    from asynctron.storage.backends import RangedFile

MiB = 1 << 20
GiB = 1 << 30
#: the most one ranged GET of a `.bin` asks for: bigger runs are split into requests of this
#: size, all in flight at once (8 MiB pieces in parallel beat one long GET)
REQUEST_BYTES = 8 * MiB
MIN_BLOCK_BYTES = 4096
#: blocks per object beyond which the automatic block size grows
MAX_BLOCKS = 4 << 20
MIN_BUDGET_BYTES = 16 * MiB
#: pieces of an `.idx` fetched at once
_INDEX_PIECE_BYTES = 32 * MiB


@dataclass
class ObjectStorageConfig:
    """Where datasets on object storage are cached on this node: megatron-core's
    `ObjectStorageConfig` (its two fields, same meaning), plus the cache's budget.

    Args:
        path_to_idx_cache: the local directory that caches the `.idx` files and the `.bin`
            ranges read (`/dev/shm/...` keeps them in memory).
        bin_chunk_nbytes: the most bytes one request reads (a miss fetches the blocks it
            needs, never a whole chunk); asynctron splits requests further into
            `REQUEST_BYTES` pieces sent together.
        cache_budget_bytes: the `.bin` bytes the cache directory keeps; the least recently
            used ranges are evicted beyond it.
        block_bytes: the unit a `.bin` is cached and evicted in (a power of two, at least
            4 KiB): a sample fetches the blocks it touches, and no more. None: 4 KiB, larger
            for objects beyond 16 GiB (at most `MAX_BLOCKS` blocks, so the block table of a
            1 TiB corpus stays ~24 MiB).
    """

    path_to_idx_cache: str
    bin_chunk_nbytes: int = 256 * MiB
    cache_budget_bytes: int = 16 * GiB
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.bin_chunk_nbytes <= 0:
            raise ValueError(f"ObjectStorageConfig.bin_chunk_nbytes: expected > 0, found "
                             f"{self.bin_chunk_nbytes}")
        block = self.block_bytes
        if block is not None and (block < MIN_BLOCK_BYTES or block & (block - 1)):
            raise ValueError(f"ObjectStorageConfig.block_bytes: expected a power of two >= "
                             f"{MIN_BLOCK_BYTES} or None, found {block}")
        if self.cache_budget_bytes < MIN_BUDGET_BYTES:
            raise ValueError(f"ObjectStorageConfig.cache_budget_bytes: expected at least "
                             f"{MIN_BUDGET_BYTES}, found {self.cache_budget_bytes}")

    @classmethod
    def of(cls, config: Any) -> ObjectStorageConfig:
        """This config from asynctron's, or from megatron-core's (or its `S3Config`)."""
        if isinstance(config, ObjectStorageConfig):
            return config
        try:
            directory = config.path_to_idx_cache
        except AttributeError:
            raise TypeError(f"object_storage_config: expected an ObjectStorageConfig (with "
                            f"path_to_idx_cache), found {type(config).__name__}") from None
        return cls(directory, bin_chunk_nbytes=getattr(config, "bin_chunk_nbytes", 256 * MiB),
                   cache_budget_bytes=getattr(config, "cache_budget_bytes", 16 * GiB),
                   block_bytes=getattr(config, "block_bytes", None))

    def block_bytes_for(self, nbytes: int) -> int:
        """The block size an object of `nbytes` is cached in."""
        if self.block_bytes is not None:
            return self.block_bytes
        block = MIN_BLOCK_BYTES
        while nbytes > block * MAX_BLOCKS:
            block *= 2
        return block

    @property
    def request_bytes(self) -> int:
        """The most one GET asks for (at least a block)."""
        return min(self.bin_chunk_nbytes, REQUEST_BYTES)


def is_object_storage_path(path: str) -> bool:
    """Whether `path` names objects in a store (a URL whose backend is `remote`: `s3://`,
    `az://`), not local files.

    Raises:
        ValueError: a URL no backend serves (naming it, and the schemes served).
    """
    return is_remote_path(path)


def cache_path(url: str, directory: str) -> str:
    """Where the object `url` is cached under `directory` (megatron's layout: the URL without
    its scheme)."""
    return os.path.join(directory, url.split("://", 1)[1])


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[int]:
    """Hold an exclusive lock on the file `path` (made if missing) against other processes;
    yields its descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def cached_index(url: str, directory: str) -> str:
    """Blocks: the local copy of the `.idx` object `url` under `directory`, fetched unless a
    copy of this version of the object is there whole (one process fetches; the others wait).

    Raises:
        FileNotFoundError: no such object (naming endpoint, bucket and key).
        StorageError: the store failed.
        OSError: the cache directory could not be written (naming it).
    """
    local = cache_path(url, directory)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with file_lock(local + ".lock"), backend_for(url).open_file(url) as source:
        expected = {"url": url, "etag": source.etag, "nbytes": source.nbytes}
        if _holds(local, expected):
            return local
        _fetch_whole(source, local)
        expected["xxh3"] = _digest_of(local)
        record = local + ".source"
        with open(record + ".tmp", "w") as out:
            json.dump(expected, out)
        os.replace(record + ".tmp", record)
    return local


def _holds(local: str, expected: dict[str, Any]) -> bool:
    """Whether `local` is a whole copy of the object `expected` describes."""
    try:
        with open(local + ".source") as f:
            record = json.load(f)
        if not isinstance(record, dict) or {k: record.get(k) for k in expected} != expected:
            return False
        return (os.path.getsize(local) == expected["nbytes"]
                and record.get("xxh3") == _digest_of(local))
    except (OSError, ValueError):
        return False


def _fetch_whole(source: RangedFile, local: str) -> None:
    """Blocks: fetch the object `source` into `local` (its pieces in flight together),
    published atomically and durably."""
    temporary = f"{local}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb+") as out:
            out.truncate(source.nbytes)
            try:  # room first: a mapped page without it kills the process (SIGBUS on tmpfs)
                os.posix_fallocate(out.fileno(), 0, max(1, source.nbytes))
            except OSError as error:
                raise OSError(error.errno, f"object cache {os.path.dirname(local)}: no room "
                              f"for the {source.nbytes}-byte {local} "
                              f"({os.strerror(error.errno)}); free space there or choose "
                              "another path_to_idx_cache") from error
            if source.nbytes:
                data = np.memmap(out, np.uint8, "r+", shape=(source.nbytes,))
                view = memoryview(data)  # type: ignore[arg-type]
                pieces = [(start, view[start:start + _INDEX_PIECE_BYTES])
                          for start in range(0, source.nbytes, _INDEX_PIECE_BYTES)]
                source.fetch(pieces).result()
                data.flush()
                del view, data, pieces
            os.fsync(out.fileno())
        os.replace(temporary, local)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def _digest_of(path: str) -> str:
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(16 * MiB):
            hasher.update(chunk)
    return hasher.hexdigest()
