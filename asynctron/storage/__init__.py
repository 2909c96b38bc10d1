"""Storage: plan and split, the manifest, the commit protocol and DCP's format, over the
backends that hold the bytes (`asynctron.storage.backends`).

Never imports the engine; blocking calls run through the `RunBlocking` door
(`asynctron._concurrency`) that the engine passes in. `__all__` is the public surface; the
names re-exported below it (`from ... import X as X`) are the seam asynctron's own parts
(`engine`, `dcp`, the CLI) build on instead of reaching into private modules: kept for them,
not promised to users.
"""

from asynctron.storage._manifest import ItemRecord, Manifest
from asynctron.storage._split import split_by_size_and_type
from asynctron.storage.backends import (
    Backend,
    Committed,
    FileWriter,
    LocalBackend,
    Retention,
    SaveArea,
    StoreStatistics,
    backend_for,
    register_backend,
    store_operation,
)

__all__ = [
    "Backend",
    "Committed",
    "FileWriter",
    "ItemRecord",
    "LocalBackend",
    "Manifest",
    "Retention",
    "SaveArea",
    "StoreStatistics",
    "backend_for",
    "register_backend",
    "split_by_size_and_type",
    "store_operation",
]

from asynctron.storage._checksum import ALGORITHMS as ALGORITHMS
from asynctron.storage._checksum import XXH3_64 as XXH3_64
from asynctron.storage._checksum import BodySegments as BodySegments
from asynctron.storage._checksum import Checksums as Checksums
from asynctron.storage._checksum import ItemHasher as ItemHasher
from asynctron.storage._checksum import digest as digest
from asynctron.storage._chunk_index import ChunkIndex as ChunkIndex
from asynctron.storage._chunk_index import Overlap as Overlap
from asynctron.storage._chunking import PlannedItem as PlannedItem
from asynctron.storage._chunking import chunk_large_items as chunk_large_items
from asynctron.storage._commit import Committer as Committer
from asynctron.storage._commit import commit_checkpoint as commit_checkpoint
from asynctron.storage._dcp import MAX_METADATA_BYTES as MAX_METADATA_BYTES
from asynctron.storage._dcp import METADATA_NAME as METADATA_NAME
from asynctron.storage._dcp import MetadataUnpickler as MetadataUnpickler
from asynctron.storage._dcp import check_object_blob as check_object_blob
from asynctron.storage._dcp import dcp_structure as dcp_structure
from asynctron.storage._dcp import decode_blob as decode_blob
from asynctron.storage._dcp import metadata_bytes as metadata_bytes
from asynctron.storage._dcp import metadata_of as metadata_of
from asynctron.storage._dcp import saved_value as saved_value
from asynctron.storage._dcp import tensor_of as tensor_of
from asynctron.storage._dcp import torch_save_frame as torch_save_frame
from asynctron.storage._dtypes import NUMPY_DTYPES as NUMPY_DTYPES
from asynctron.storage._dtypes import TORCH_DTYPES as TORCH_DTYPES
from asynctron.storage._dtypes import dtype_name as dtype_name
from asynctron.storage._layout import ALIGN_BYTES as ALIGN_BYTES
from asynctron.storage._layout import SMALL_ALIGN_BYTES as SMALL_ALIGN_BYTES
from asynctron.storage._layout import Batches as Batches
from asynctron.storage._layout import BinLayout as BinLayout
from asynctron.storage._layout import Part as Part
from asynctron.storage._layout import align_up as align_up
from asynctron.storage._layout import bin_file_name as bin_file_name
from asynctron.storage._layout import layout_bin as layout_bin
from asynctron.storage._manifest import MANIFEST_NAME as MANIFEST_NAME
from asynctron.storage._manifest import MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES
from asynctron.storage._manifest import ShardInfo as ShardInfo
from asynctron.storage._manifest import encode_manifest as encode_manifest
from asynctron.storage._manifest import parse_manifest as parse_manifest
from asynctron.storage._manifest import paused_gc as paused_gc
from asynctron.storage._plan import PLAIN_TENSORS as PLAIN_TENSORS
from asynctron.storage._plan import FlatStateDict as FlatStateDict
from asynctron.storage._plan import ItemKind as ItemKind
from asynctron.storage._plan import PlainPlan as PlainPlan
from asynctron.storage._plan import SavePlan as SavePlan
from asynctron.storage._plan import Structure as Structure
from asynctron.storage._plan import flatten as flatten
from asynctron.storage._plan import is_plain as is_plain
from asynctron.storage._plan import item_paths as item_paths
from asynctron.storage._plan import merge_structures as merge_structures
from asynctron.storage._plan import plan_final as plan_final
from asynctron.storage._plan import plan_global as plan_global
from asynctron.storage._plan import plan_local as plan_local
from asynctron.storage._plan import plan_plain_global as plan_plain_global
from asynctron.storage._plan import unflatten as unflatten
from asynctron.storage._plan import value_paths as value_paths
from asynctron.storage._read_plan import MAX_GAP_BYTES as MAX_GAP_BYTES
from asynctron.storage._read_plan import ReadJob as ReadJob
from asynctron.storage.backends._backend import CheckpointReader as CheckpointReader
from asynctron.storage.backends._backend import CheckpointStorage as CheckpointStorage
from asynctron.storage.backends._backend import CommittedCheckpoints as CommittedCheckpoints
from asynctron.storage.backends._backend import FileStorage as FileStorage
from asynctron.storage.backends._backend import ItemReader as ItemReader
from asynctron.storage.backends._backend import ReadableFile as ReadableFile
from asynctron.storage.backends._backend import SaveStorage as SaveStorage
from asynctron.storage.backends._operation import StoreOperation as StoreOperation
from asynctron.storage.backends._write_batch import WriteBatch as WriteBatch
from asynctron.storage.backends.local._publish import resolve_checkpoint as resolve_checkpoint
from asynctron.storage.backends.local._reader import read_manifest as read_manifest
from asynctron.storage.backends.local._sysio import FileIO as FileIO
from asynctron.storage.backends.local._sysio import LocalFileIO as LocalFileIO
