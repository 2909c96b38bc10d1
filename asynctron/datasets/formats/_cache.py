"""The index cache: `.npy` files named by a hash of everything that changes the indices.

A cache entry is `<hash>-<Class>-<split>-<name>.npy` for each index plus
`<hash>-<Class>-<split>-description.txt`, the JSON the hash is taken of. Every file goes
through the storage backend of the cache directory (`backend_for`). The arrays are published
at once, one thread each (`publish_buffers`: past the page cache where the storage allows, each
made durable under a temporary name and renamed); the renames are made durable (`sync_dir`);
only then is the description published. So after a crash at any point an entry either has its
description and every array whole, or has no description and is rebuilt. Loads take each array
whole (`whole_file`: mapped where the storage maps files) and check its `.npy` header, dtype
and shape, so a truncated or foreign file is an error naming it.

Nothing here is a collective: under torch.distributed, `BlendedMegatronDatasetBuilder` lets
rank 0 build every entry before the other ranks look (as megatron-core's builder does). With
`must_exist` (megatron's `fast_cache_load`) an entry is only loaded; a missing one is an error
naming it. `observing(callback)` reports every entry loaded or built (`prepare-cache` prints
them).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from asynctron.errors import CorruptDatasetError
from asynctron.storage.backends import backend_for, whole_file

if TYPE_CHECKING:
    from asynctron.storage.backends import Backend

logger = logging.getLogger(__name__)

#: Bumped when the meaning of a cached index changes.
CACHE_FORMAT_VERSION = 1

#: name -> (allowed dtypes, number of dimensions, columns or None) of each cached array
Layout = Mapping[str, tuple[tuple[Any, ...], int, int | None]]


def describe(identity: Mapping[str, Any]) -> tuple[str, str]:
    """The description JSON of `identity` and its md5 hex digest (the cache key)."""
    text = json.dumps({"cache_format": CACHE_FORMAT_VERSION, **identity}, indent=4)
    return text, hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """The files of one cached set of indices: those of the dataset class `class_name`, split
    `split`, whose `description` has the md5 `description_hash`."""

    directory: str
    description_hash: str
    class_name: str
    split: str
    description: str

    @property
    def stem(self) -> str:
        """`<hash>-<Class>-<split>`, the start of every file name of the entry."""
        return f"{self.description_hash}-{self.class_name}-{self.split}"

    def path(self, name: str) -> str:
        return os.path.join(self.directory, f"{self.stem}-{name}")

    def complete(self) -> bool:
        """Whether the entry's description is published (so every array is) and is this one."""
        path = self.path("description.txt")
        try:
            with backend_for(path).open_file(path) as f:
                return f.pread(f.nbytes, 0) == self.description.encode()
        except (FileNotFoundError, IsADirectoryError):
            return False

    def load(self, layout: Layout) -> dict[str, np.ndarray]:
        """Map every array; check its dtype and shape against `layout`."""
        arrays = {}
        for name, (dtypes, ndim, columns) in layout.items():
            path = self.path(f"{name}.npy")
            try:
                array = _map_npy(path)
            except (ValueError, OSError, EOFError) as exc:
                raise CorruptDatasetError(
                    f"cached index {path}: expected a readable .npy, found {exc}; delete the "
                    "file to rebuild it", path=path) from exc
            shape_ok = array.ndim == ndim and (columns is None or array.shape[-1] == columns)
            if array.dtype not in dtypes or not shape_ok:
                raise CorruptDatasetError(
                    f"cached index {path}: expected dtype in {[np.dtype(d).name for d in dtypes]}"
                    f" with {ndim} dimensions, found {array.dtype.name} {array.shape}; delete "
                    "the file to rebuild it", path=path)
            arrays[name] = array
        return arrays

    def save(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Publish every array as `.npy` (at once, a thread each) and make their renames
        durable, then the description: a description in place means every array is (the
        backend creates the directory). Blocking call.

        Raises:
            OSError: a file could not be published (naming it); no description is.
        """
        backend = backend_for(self.directory)
        with ThreadPoolExecutor(max_workers=max(1, len(arrays)),
                                thread_name_prefix="asynctron-cache-save") as pool:
            writes = [pool.submit(_save_npy, backend, self.path(f"{name}.npy"), array)
                      for name, array in arrays.items()]
        for write in writes:
            write.result()
        if writes:  # else the description's publish makes the directory
            backend.sync_dir(self.directory)
        backend.publish_file(self.path("description.txt"),
                             lambda f: f.write(self.description.encode()))


def _save_npy(backend: Backend, path: str, array: np.ndarray) -> None:
    """Publish `array` as the `.npy` file `path` (the bytes `np.save` writes); the directory
    is not synced."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    data = memoryview(array.reshape(-1).view(np.uint8))
    backend.publish_buffers(path, [header.getbuffer(), data], sync_dir=False)


def _map_npy(path: str) -> np.ndarray:
    """The array of the `.npy` file `path`: a read-only view of the file's map (what
    `np.load(path, mmap_mode="r")` gives, as a plain ndarray: faster to index).

    Raises:
        ValueError, EOFError: not a `.npy` file numpy reads without pickle, or truncated.
        OSError: the file could not be mapped.
    """
    mapped = whole_file(backend_for(path), path)
    header = _Cursor(mapped)
    version = np.lib.format.read_magic(header)
    read_header = _HEADER_READERS.get(version)
    if read_header is None:
        raise ValueError(f".npy format version {version}: expected one of "
                         f"{sorted(_HEADER_READERS)}")
    shape, fortran_order, dtype = read_header(header)
    if dtype.hasobject:
        raise ValueError("an object array (it would need pickle)")
    end = header.position + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end > len(mapped):
        raise EOFError(f"a file of {len(mapped)} bytes, where its header's {shape} "
                       f"{dtype.name} array ends at byte {end}")
    return np.ndarray(shape, dtype, buffer=mapped, offset=header.position,
                      order="F" if fortran_order else "C")


_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}


class _Cursor:
    """`read` through a buffer (a file's map), as numpy's `.npy` header readers need."""

    def __init__(self, buffer: bytes | mmap.mmap) -> None:
        self._view = memoryview(buffer)
        self.position = 0

    def read(self, nbytes: int) -> bytes:
        data = self._view[self.position:self.position + nbytes].tobytes()
        self.position += len(data)
        return data


@dataclass(frozen=True, slots=True)
class CacheUse:
    """One `load_or_build` of an entry: built (and saved) now, or loaded; each array's length;
    the seconds it took."""

    entry: CacheEntry
    built: bool
    lengths: dict[str, int]
    seconds: float


_observers: list[Callable[[CacheUse], None]] = []


@contextlib.contextmanager
def observing(callback: Callable[[CacheUse], None]) -> Iterator[None]:
    """Call `callback` after each `load_or_build` of an entry while the block runs, from
    whichever thread of this process ran it."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def load_or_build(entry: CacheEntry | None, layout: Layout,
                  build: Callable[[], dict[str, np.ndarray]],
                  must_exist: bool = False) -> dict[str, np.ndarray]:
    """The cached arrays of `entry`, built and saved when missing; with no entry, just
    `build()`. No collective: under torch.distributed the dataset builder lets rank 0 build
    first; a rank that still finds the entry missing builds it too (the files are published by
    rename, so concurrent builds publish the same entry).

    With `must_exist` the entry is loaded, never built.

    Raises:
        FileNotFoundError: `must_exist` and the entry is not complete; names its description.
        ValueError: the entry's directory is a URL no storage backend serves.
    """
    if entry is None:
        return build()
    start = time.perf_counter()
    built = not must_exist and not entry.complete()
    if built:
        logger.info("building indices %s in %s", entry.stem, entry.directory)
        arrays = build()
        entry.save(arrays)
    else:
        if must_exist and not entry.complete():
            raise FileNotFoundError(
                f"cached indices {entry.path('description.txt')}: expected the complete cache "
                "entry this config describes (fast_cache_load), found none; build the cache "
                "first with `asynctron prepare-cache CONFIG`, or with a run without "
                "fast_cache_load")
        arrays = entry.load(layout)
    if _observers:
        use = CacheUse(entry, built, {name: len(array) for name, array in arrays.items()},
                       time.perf_counter() - start)
        for callback in tuple(_observers):
            callback(use)
    return arrays
