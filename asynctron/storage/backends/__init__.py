"""Where bytes live: the `Backend` seam and its implementations, one module (or folder) each.

    backend_for("ckpt/step_100")        # LocalBackend: a path on this machine
    backend_for("s3://bucket/run")      # S3Backend: an S3-compatible store (the AWS chain's)
    backend_for("az://container/run")   # AzureBackend: Azure Blob Storage (AZURE_STORAGE_*)
    backend_for("gs://bucket/run")      # GcsBackend: Google Cloud Storage (its ADC)

A new backend implements `Backend` in its own module and registers a factory for its URL
scheme with `register_backend`; nothing above `storage` changes. A new object store is one
`ObjectClient` (`objects/`) and one line below.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable

from asynctron.storage.backends._backend import (
    Backend,
    CheckpointLease,
    CheckpointReader,
    CheckpointStorage,
    Committed,
    CommittedCheckpoints,
    FileStorage,
    FileWriter,
    ItemReader,
    MappableFiles,
    MappedItems,
    NewFile,
    RangedFile,
    RangedFiles,
    ReadableFile,
    Retention,
    SaveArea,
    SaveStorage,
    whole_file,
)
from asynctron.storage.backends._commit import Committer, commit_checkpoint
from asynctron.storage.backends._operation import StoreOperation, StoreStatistics, store_operation
from asynctron.storage.backends._write_batch import WriteBatch
from asynctron.storage.backends.local import LocalBackend

__all__ = ["Backend", "CheckpointLease", "CheckpointReader", "CheckpointStorage", "Committed",
           "CommittedCheckpoints", "Committer", "FileStorage", "FileWriter", "ItemReader",
           "LocalBackend", "MappableFiles", "MappedItems", "NewFile", "RangedFile",
           "RangedFiles", "ReadableFile", "Retention", "SaveArea", "SaveStorage",
           "StoreOperation", "StoreStatistics", "WriteBatch", "backend_for",
           "commit_checkpoint", "register_backend", "served_scheme", "serves_ranged_files",
           "store_operation", "whole_file"]

_FACTORIES: dict[str, Callable[[], Backend]] = {}
_SHARED: dict[str, Backend] = {}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_MISTYPED_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/*([^/].*)?$")
"""A first path component that ends in `:`-something, as `s3:/bucket/x` or `s3:bucket/x`
(`pathlib.Path("s3://b/x")` gives the first): a URL mistyped, never taken for a local path."""
_MISSING_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)//+(.*)$")
"""A first path component followed by `//`, as `s3//bucket/x`: a URL missing its `:` when
that component is a served scheme or one of `_ALIASES` (else a local path)."""
_ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs", "azure": "az"}
"""Schemes other tools use for a scheme served here (Hadoop's for S3, fsspec's `gcs`, the
store's name for Azure): refused with a hint naming the served one, never served, so that a
checkpoint has one name."""
_LOCAL = "file"
"""The key of plain paths (no URL scheme): the local filesystem. A `file://` URL is refused
(pass the path itself), so that no backend ever sees one."""


def register_backend(scheme: str, factory: Callable[[], Backend]
                     ) -> Callable[[], Backend] | None:
    """Make `backend_for` serve URLs `<scheme>://...` with one `factory()` per process
    (`"file"`: plain paths, the local filesystem); returns the factory it replaced (None:
    none), to register again to undo."""
    replaced = _FACTORIES.get(scheme.lower())
    _FACTORIES[scheme.lower()] = factory
    _SHARED.pop(scheme.lower(), None)
    return replaced


def backend_for(path: str | os.PathLike[str]) -> Backend:
    """The process's backend for `path`: the local filesystem's for a plain path, else the
    one registered for its URL scheme.

    Raises:
        TypeError: `path` is not a str or os.PathLike.
        ValueError: a URL whose scheme no backend serves, or a path that looks like a mistyped
            URL (`s3:/bucket/x`, `s3//bucket/x`): never taken for a local path.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path: expected a str or os.PathLike, found {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"path: expected a str path, found {type(text).__name__}")
    scheme = served_scheme(text)
    backend = _SHARED.get(scheme)
    if backend is None:
        backend = _SHARED[scheme] = _FACTORIES[scheme]()
    return backend


def served_scheme(path: str) -> str:
    """The scheme of the backend `backend_for(path)` gives (`"file"`: a plain path, the local
    filesystem), checked as `backend_for` checks it, without making the backend.

    Raises:
        ValueError: as `backend_for`.
    """
    served = ", ".join(f"{known}://" for known in sorted(_FACTORIES) if known != _LOCAL)
    match = _SCHEME.match(path)
    if match:
        scheme = match[1].lower()
        if scheme != _LOCAL and scheme in _FACTORIES:
            return scheme
        meant = _meant(scheme, path[match.end():])
        hint = (f"; did you mean {meant!r}?" if meant
                else "; a URL is never taken for a local path")
        raise ValueError(
            f"path {path!r}: expected a local path or a URL a storage backend serves "
            f"({served or 'none registered'}), found the scheme {scheme!r}{hint}")
    mistyped = _MISTYPED_SCHEME.match(path)
    doubled = None if mistyped else _MISSING_COLON.match(path)
    if mistyped:
        meant = (_meant(mistyped[1].lower(), mistyped[2] or "")
                 or f"{mistyped[1]}://{mistyped[2] or ''}")
        missing, first = "'://'", "has a ':'"
        pathlib_hint = (" (pathlib.Path turns 's3://b' into 's3:/b': pass URLs as str)"
                        if path.startswith(f"{mistyped[1]}:/") else "")
    elif doubled and (doubled_meant := _meant(doubled[1].lower(), doubled[2])):
        meant, missing, first, pathlib_hint = doubled_meant, "':'", f"is {doubled[1]!r}", ""
    else:
        return _LOCAL
    raise ValueError(
        f"path {path!r}: expected a local path or a URL ({served or 'none registered'}), "
        f"found what looks like a URL missing its {missing}; did you mean {meant!r}?"
        f"{pathlib_hint} A local path whose first name {first} is written {'./' + path!r}")


def _meant(scheme: str, rest: str) -> str | None:
    """`scheme://rest` with `scheme` as served (itself, or the served scheme it is an alias
    of); None if no backend serves it."""
    scheme = _ALIASES.get(scheme, scheme)
    return f"{scheme}://{rest}" if scheme != _LOCAL and scheme in _FACTORIES else None


_FACTORIES[_LOCAL] = LocalBackend


def serves_ranged_files(path: str) -> bool:
    """Whether `path`'s backend reads its files in ranged requests over a network
    (`RangedFiles`: an object store), without making the process's backend for a cloud scheme
    (it reads its settings once, when made).

    Raises:
        ValueError: a URL no backend serves, or a mistyped one (as `backend_for`).
    """
    scheme = served_scheme(path)
    if scheme == _LOCAL:
        return False
    if _FACTORIES[scheme] in _CLOUDS:
        return True
    return isinstance(backend_for(path), RangedFiles)


_CLOUDS: set[Callable[[], Backend]] = set()
"""The factories of the object stores asynctron ships (their backends are all `RangedFiles`)."""


def _cloud(module: str, name: str, extra: str, needs: str) -> Callable[[], Backend]:
    """A factory of `module.name`, imported on first use (a cloud SDK costs ~1 s to import);
    without the SDK, a ValueError naming the extra to install."""
    def factory() -> Backend:
        try:
            backend = getattr(importlib.import_module(module), name)
        except ImportError as error:
            raise ValueError(f"{name} needs {needs} ({error}); install "
                             f"`pip install 'asynctron[{extra}]'`") from error
        return backend()

    _CLOUDS.add(factory)
    return factory


_FACTORIES["s3"] = _cloud("asynctron.storage.backends.s3", "S3Backend", "s3", "aiobotocore")
_FACTORIES["az"] = _FACTORIES["abfs"] = _cloud(
    "asynctron.storage.backends.azure", "AzureBackend", "azure", "azure-storage-blob")
_FACTORIES["gs"] = _cloud("asynctron.storage.backends.gcs", "GcsBackend", "gcs", "aiohttp")
