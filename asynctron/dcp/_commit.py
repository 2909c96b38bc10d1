"""The coordinator's commit of a DCP save: the checkpoint appears at its path complete, or not
at all.

Stages (the coordinator, in `StorageWriter.finish`, once DCP has gathered every rank's write
results; each rank's data files are already fsynced by then):
1. `checkpoint_files`: DCP's global metadata, completed with where every item is (and each
   tensor's chunks as written), pickled as `.metadata`, which stock `FileSystemReader` reads;
   and asynctron's `manifest.json` (every item's raw bytes and digest, the nesting from the
   planner's data), which asynctron's readers verify against;
2. `publish` (blocks): both written and fsynced into the tmp dir, the tmp dir fsynced, renamed
   to the checkpoint path (never over an existing one), the parent fsynced, then the debris of
   dead saves in the parent removed (as asynctron's own commit does). No `latest` pointer is
   written: DCP checkpoints are found by path.
A crash before the rename leaves only the tmp dir (`.<name>.tmp-dcp`), which no reader takes
for a checkpoint and the next commit in that directory (or the next save to that path) removes.

The tmp dir's name is derived from the checkpoint path alone (`tmp_dir_of`), which is unique
per save: every rank finds it without being told, so no plan carries per-save state (DCP's
plan caching hands a later save the plans of the first).
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from asynctron.dcp._write_job import ItemWritten
from asynctron.engine._coordinator import prepare_tmp_dir as engine_prepare_tmp_dir
from asynctron.errors import AsynctronError
from asynctron.storage import _commit, _retention
from asynctron.storage._dcp import METADATA_NAME, _structure
from asynctron.storage._locks import DirLock
from asynctron.storage._manifest import MANIFEST_NAME, encode_manifest

#: What ends the name of a DCP save's tmp dir, `.<name>.tmp-dcp` (`_commit.TMP_MARK` inside, so
#: asynctron's cleaners know it for a tmp dir).
TMP_SUFFIX = _commit.TMP_MARK + "dcp"


def tmp_dir_of(final_path: str) -> str:
    """The tmp dir of the save to `final_path`, beside it: the same on every rank."""
    parent, name = os.path.split(os.path.abspath(final_path))
    return os.path.join(parent, f".{name}{TMP_SUFFIX}")


def prepare_tmp_dir(final_path: str) -> DirLock:
    """Blocks (coordinator): refuse an existing `final_path`, then create its tmp dir fresh
    (`tmp_dir_of`), replacing one a dead save left, as the engine's own saves do; returns the
    lock that marks it live (release it once committed or removed).

    Raises:
        FileExistsError: `final_path` exists, or another live save to it holds its tmp dir.
        StorageError: the tmp dir could not be created or the stale one removed.
    """
    return engine_prepare_tmp_dir(final_path, tmp_dir_of(final_path))


def checkpoint_files(metadata: Metadata, results: Sequence[Sequence[WriteResult]], *,
                     storage_meta: StorageMeta, checksum: str | None,
                     created_unix_s: float) -> dict[str, bytes]:
    """Blocks (CPU-bound): `.metadata` and `manifest.json` for every rank's `results`.
    Completes `metadata` in place (storage data, chunks as written, version, storage meta),
    as stock `FileSystemWriter.finish` does: `dcp.save` returns it.

    Raises:
        ValueError: a result not made by asynctron's `StorageWriter`, or for a key DCP's
            metadata does not hold (naming it).
    """
    written: list[ItemWritten] = []
    for rank, rank_results in enumerate(results):
        for result in rank_results:
            if not isinstance(result.storage_data, ItemWritten):
                raise ValueError(f"write result for {result.index.fqn!r} from rank {rank}: "
                                 "expected one made by asynctron.dcp.StorageWriter, found "
                                 f"{type(result.storage_data).__name__}; use "
                                 "asynctron.dcp.StorageWriter on every rank")
            written.append(result.storage_data)
    chunks: dict[str, list[ChunkStorageMetadata]] = {}
    storage_data = {}
    for item in written:
        record = item.record
        entry = metadata.state_dict_metadata.get(record.key)
        if entry is None:
            raise ValueError(f"write result for {record.key!r}: expected a key of DCP's "
                             "global metadata, found none; the plan and the results differ")
        if record.kind == "object":
            storage_data[MetadataIndex(record.key)] = item.storage
            continue
        assert isinstance(entry, TensorStorageMetadata)
        assert record.chunk_offsets is not None and record.shape is not None
        key_chunks = chunks.setdefault(record.key, [])
        key_chunks.append(ChunkStorageMetadata(offsets=torch.Size(record.chunk_offsets),
                                               sizes=torch.Size(record.shape)))
        storage_data[MetadataIndex(record.key, key_chunks[-1].offsets,
                                   len(key_chunks) - 1)] = item.storage
    for key, key_chunks in chunks.items():
        entry = metadata.state_dict_metadata[key]
        assert isinstance(entry, TensorStorageMetadata)
        entry.chunks = key_chunks
    metadata.storage_data = storage_data
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_meta = storage_meta
    stored = {item.record.key for item in written}
    structure = _structure(metadata.planner_data,
                           [key for key in metadata.state_dict_metadata if key in stored])
    files = {item.record.file: item.file_bytes for item in written}
    manifest = encode_manifest(structure=json.dumps(structure, separators=(",", ":")),
                               items=[item.record for item in written], checksums=None,
                               files=files, created_unix_s=created_unix_s, checksum=checksum)
    return {METADATA_NAME: pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL),
            MANIFEST_NAME: manifest}


def publish(tmp_dir: str, final_path: str, files: Mapping[str, bytes]) -> list[str]:
    """Blocks: seal `tmp_dir` with `files` and rename it to `final_path` (the commit), under
    the parent's exclusive lock; then remove the debris of dead saves there. Returns the
    problems after the commit that did not undo it (the caller logs them).

    Raises:
        FileExistsError: `final_path` appeared meanwhile; nothing is committed.
        StorageError: a write, fsync or the rename failed; nothing is committed.
    """
    warnings = []
    removal = _retention.Removal()
    root = os.path.realpath(os.path.dirname(final_path))
    with DirLock.take(root, exclusive=True) as root_lock:
        _commit.seal_dir(tmp_dir, files)
        _commit.publish_dir(tmp_dir, final_path)
        try:
            removal = _retention.retire(root_lock, None)
        except AsynctronError as error:
            warnings.append(f"checkpoint {final_path} is committed, but removing the debris of "
                            f"dead saves beside it failed: {error}")
    warnings.extend(removal.run())
    return warnings
