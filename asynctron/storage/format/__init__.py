"""What a checkpoint *is*, with no I/O: the save plan and its chunking and split into bins,
each bin's layout, the manifest and its checksums, the reads a load plans, and DCP's format
(`.metadata`, its unpickling guards, torch.save frames).

Everything here is pure: given bytes or a state dict it returns plans, records and bytes, and
where it blocks it is CPU work. Where those bytes live is `asynctron.storage.backends`.
`__all__` is this face, frozen by `tests/test_public_api.py`: what asynctron's engine, DCP
plugins, backends and CLI build on.
"""

from asynctron.storage.format._checksum import (
    ALGORITHMS,
    XXH3_64,
    BodySegments,
    Checksums,
    ItemHasher,
    check_digest,
    digest,
)
from asynctron.storage.format._chunk_index import ChunkIndex, Overlap
from asynctron.storage.format._chunking import PlannedItem, chunk_large_items
from asynctron.storage.format._dcp import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    MetadataUnpickler,
    check_object_blob,
    dcp_structure,
    decode_blob,
    metadata_bytes,
    metadata_of,
    parse_dcp_manifest,
    saved_value,
    tensor_of,
    torch_save_frame,
)
from asynctron.storage.format._dtypes import NUMPY_DTYPES, TORCH_DTYPES, dtype_name
from asynctron.storage.format._layout import (
    ALIGN_BYTES,
    SMALL_ALIGN_BYTES,
    Batches,
    BinLayout,
    Part,
    align_up,
    bin_file_name,
    layout_bin,
)
from asynctron.storage.format._manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ItemRecord,
    Manifest,
    ShardInfo,
    encode_manifest,
    parse_manifest,
    paused_gc,
)
from asynctron.storage.format._plan import (
    PLAIN_TENSORS,
    FlatStateDict,
    ItemKind,
    PlainPlan,
    SavePlan,
    Structure,
    flatten,
    is_plain,
    item_paths,
    merge_structures,
    plan_final,
    plan_global,
    plan_local,
    plan_plain_global,
    unflatten,
    value_paths,
)
from asynctron.storage.format._read_plan import (
    MAX_GAP_BYTES,
    ReadBatch,
    ReadJob,
    check_files,
    check_no_overlap,
    plan_reads,
)
from asynctron.storage.format._split import split_by_size_and_type

__all__ = ["ALGORITHMS", "ALIGN_BYTES", "MANIFEST_NAME", "MAX_GAP_BYTES", "MAX_MANIFEST_BYTES",
           "MAX_METADATA_BYTES", "METADATA_NAME", "NUMPY_DTYPES", "PLAIN_TENSORS",
           "SMALL_ALIGN_BYTES", "TORCH_DTYPES", "XXH3_64", "Batches", "BinLayout", "BodySegments",
           "Checksums", "ChunkIndex", "FlatStateDict", "ItemHasher", "ItemKind", "ItemRecord",
           "Manifest", "MetadataUnpickler", "Overlap", "Part", "PlainPlan", "PlannedItem",
           "ReadBatch", "ReadJob", "SavePlan", "ShardInfo", "Structure", "align_up",
           "bin_file_name", "check_digest", "check_files", "check_no_overlap", "check_object_blob",
           "chunk_large_items", "dcp_structure", "decode_blob", "digest", "dtype_name",
           "encode_manifest", "flatten", "is_plain", "item_paths", "layout_bin",
           "merge_structures", "metadata_bytes", "metadata_of", "parse_dcp_manifest",
           "parse_manifest", "paused_gc", "plan_final", "plan_global", "plan_local",
           "plan_plain_global", "plan_reads", "saved_value", "split_by_size_and_type", "tensor_of",
           "torch_save_frame", "unflatten", "value_paths"]
