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
from asynctron.storage.backends.local._publish import resolve_checkpoint
from asynctron.storage.backends.local._reader import read_manifest
from asynctron.storage.backends.local._sysio import FileIO, LocalFileIO

__all__ = [
    "Backend",
    "Committed",
    "FileIO",
    "FileWriter",
    "ItemRecord",
    "LocalBackend",
    "LocalFileIO",
    "Manifest",
    "Retention",
    "SaveArea",
    "StoreStatistics",
    "backend_for",
    "read_manifest",
    "register_backend",
    "resolve_checkpoint",
    "split_by_size_and_type",
    "store_operation",
]

from asynctron.storage._checksum import digest as digest
from asynctron.storage._commit import Committer as Committer
from asynctron.storage._commit import commit_checkpoint as commit_checkpoint
from asynctron.storage._dcp import MAX_METADATA_BYTES as MAX_METADATA_BYTES
from asynctron.storage._dcp import METADATA_NAME as METADATA_NAME
from asynctron.storage._dcp import MetadataUnpickler as MetadataUnpickler
from asynctron.storage._dcp import check_object_blob as check_object_blob
from asynctron.storage._dcp import dcp_structure as dcp_structure
from asynctron.storage._dcp import decode_blob as decode_blob
from asynctron.storage._dcp import tensor_of as tensor_of
from asynctron.storage._dtypes import TORCH_DTYPES as TORCH_DTYPES
from asynctron.storage._layout import ALIGN_BYTES as ALIGN_BYTES
from asynctron.storage._layout import SMALL_ALIGN_BYTES as SMALL_ALIGN_BYTES
from asynctron.storage._layout import align_up as align_up
from asynctron.storage._manifest import MANIFEST_NAME as MANIFEST_NAME
from asynctron.storage._manifest import MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES
from asynctron.storage._manifest import encode_manifest as encode_manifest
from asynctron.storage._manifest import parse_manifest as parse_manifest
from asynctron.storage._manifest import paused_gc as paused_gc
from asynctron.storage._plan import FlatStateDict as FlatStateDict
from asynctron.storage._plan import ItemKind as ItemKind
from asynctron.storage._plan import SavePlan as SavePlan
from asynctron.storage._plan import merge_structures as merge_structures
from asynctron.storage._plan import value_paths as value_paths
from asynctron.storage._read_plan import MAX_GAP_BYTES as MAX_GAP_BYTES
from asynctron.storage._read_plan import ReadJob as ReadJob
from asynctron.storage.backends._backend import CheckpointReader as CheckpointReader
from asynctron.storage.backends._backend import ReadableFile as ReadableFile
from asynctron.storage.backends._operation import StoreOperation as StoreOperation
from asynctron.storage.backends._write_batch import WriteBatch as WriteBatch
