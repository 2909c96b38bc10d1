"""The coordinator's commit of a DCP save: the checkpoint appears at its path complete, or not
at all.

Stages (the coordinator, in `StorageWriter.finish`, once DCP has gathered every rank's write
results; each rank's data files are already durable by then):
1. `checkpoint_files`: DCP's global metadata, completed with where every item is (and each
   tensor's chunks as written), pickled as `.metadata`, which stock `FileSystemReader` reads;
   and asynctron's `manifest.json` (every item's raw bytes and digest, the nesting from the
   planner's data), which asynctron's readers verify against;
2. storage's `commit_checkpoint` (the engine's commit too): both written into the save's area
   last, the area published as the checkpoint (never over an existing one), then the debris
   of dead saves beside it removed. No `latest` pointer is written: DCP checkpoints are found
   by path.
A crash before the publish leaves only the area, which no reader takes for a checkpoint and
the next commit beside it (or the next save to that path) removes.

The area is named from the checkpoint path alone (`area_of`), which is unique per save:
every rank finds it without being told, so no plan carries per-save state (DCP's plan caching
hands a later save the plans of the first).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence

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
from asynctron.storage import SaveArea
from asynctron.storage.backends import SaveStorage
from asynctron.storage.format import MANIFEST_NAME, METADATA_NAME, dcp_structure, encode_manifest

#: The name of a DCP save's area. With the checkpoint's name it names the area, the same on
#: every rank: on a filesystem the tmp dir `.asynctron.tmp-<digest of both>`, which holds
#: nothing of the checkpoint's name (a scan for `step-<digits>` folders never takes it for one).
AREA_NAME = "dcp"


def area_of(storage: SaveStorage, final_path: str) -> SaveArea:
    """The area of the save to `final_path`: the same on every rank."""
    return storage.area_of(final_path, AREA_NAME)


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
    structure = dcp_structure(metadata.planner_data,
                           [key for key in metadata.state_dict_metadata if key in stored])
    files = {item.record.file: item.file_bytes for item in written}
    manifest = encode_manifest(structure=json.dumps(structure, separators=(",", ":")),
                               items=[item.record for item in written], checksums=None,
                               files=files, created_unix_s=created_unix_s, checksum=checksum)
    return {METADATA_NAME: pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL),
            MANIFEST_NAME: manifest}
