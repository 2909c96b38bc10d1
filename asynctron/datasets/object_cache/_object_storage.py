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
import errno
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from asynctron.storage.backends import RangedFiles, backend_for, serves_ranged_files, whole_file
from asynctron.storage.node_files import file_size, holding, publish_filled, read_head

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
#: the most an `.idx`'s `.source` record holds (its URL is the long part)
_RECORD_MOST_BYTES = 64 << 10
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


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
    """Whether `path` names objects in a store (a URL whose backend is `RangedFiles`: `s3://`,
    `az://`), not local files.

    Raises:
        ValueError: a URL no backend serves (naming it, and the schemes served).
    """
    return serves_ranged_files(path)


def cache_path(url: str, directory: str) -> str:
    """Where the object `url` is cached under `directory` (megatron's layout: the URL without
    its scheme)."""
    return os.path.join(directory, url.split("://", 1)[1])


@contextlib.contextmanager
def naming_the_cache(directory: str) -> Iterator[None]:
    """A full or read-only cache disk's OSError raised again naming the cache `directory` and
    what to do (others pass as they are: they name their file)."""
    try:
        yield
    except OSError as error:
        if error.errno not in _NO_ROOM and error.errno != errno.EROFS:
            raise
        remedy = "free space there" if error.errno in _NO_ROOM else "make it writable"
        raise OSError(error.errno, f"object cache {directory}: {error.strerror}; {remedy} or "
                      "choose another path_to_idx_cache", error.filename) from error


def cached_index(url: str, directory: str) -> str:
    """Blocks: the local copy of the `.idx` object `url` under `directory`, fetched unless a
    copy of this version of the object is there whole (one process fetches; the others wait).

    Raises:
        FileNotFoundError: no such object (naming endpoint, bucket and key).
        StorageError: the store failed.
        OSError: the cache directory could not be written (naming it).
    """
    local = cache_path(url, directory)
    with (naming_the_cache(directory), holding(local + ".lock"),
          open_object(url) as source):
        expected = {"url": url, "etag": source.etag, "nbytes": source.nbytes}
        if _holds(local, expected):
            return local
        publish_filled(local, source.nbytes, lambda view: _fetch_into(source, view))
        expected["xxh3"] = _digest_of(local)
        backend_for(local).publish_buffers(local + ".source", [json.dumps(expected).encode()])
    return local


def _holds(local: str, expected: dict[str, Any]) -> bool:
    """Whether `local` is a whole copy of the object `expected` describes."""
    try:
        record = json.loads(read_head(local + ".source", _RECORD_MOST_BYTES) or b"null")
        if not isinstance(record, dict) or {k: record.get(k) for k in expected} != expected:
            return False
        return (file_size(local) == expected["nbytes"]
                and record.get("xxh3") == _digest_of(local))
    except (OSError, ValueError):
        return False


def open_object(url: str) -> RangedFile:
    """Blocks: the object `url` (one version of it), opened for many ranged reads at once.

    Raises:
        ValueError: `url`'s backend is not an object store's (`RangedFiles`).
        FileNotFoundError: no such object.
    """
    backend = backend_for(url)
    if not isinstance(backend, RangedFiles):
        raise ValueError(f"dataset {url}: expected an object store's URL (s3://, az://, gs://), "
                         f"found one whose backend ({type(backend).__name__}) maps its files")
    return backend.open_ranged_file(url)


def _fetch_into(source: RangedFile, view: memoryview) -> None:
    """Blocks: the whole object `source` into `view`, its pieces in flight together."""
    pieces = [(start, view[start:start + _INDEX_PIECE_BYTES])
              for start in range(0, view.nbytes, _INDEX_PIECE_BYTES)]
    source.fetch(pieces).result()


def _digest_of(path: str) -> str:
    mapped = whole_file(backend_for(path), path)
    try:
        return xxhash.xxh3_64(mapped).hexdigest()
    finally:
        if not isinstance(mapped, bytes):
            mapped.close()
