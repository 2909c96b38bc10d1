"""Datasets: megatron-compatible token files, GPT samples, blends, and an async prefetching loader.

`IndexedDataset` reads megatron's `.bin`/`.idx` files (and `IndexedDatasetBuilder` writes them),
`GPTDataset`, `MockGPTDataset` and `BlendedDataset` build megatron-core's indices (the same
arrays) and samples, `BlendedMegatronDatasetBuilder` builds the splits of any megatron dataset
class (`build_gpt_datasets` for GPT) and `prepare_cache` builds their indices ahead, and
`AsyncLoader`
serves batches assembled by worker processes in shared memory, the pages of coming samples
read ahead under a byte budget.
"""

from asynctron.datasets.formats._blend_builder import (
    BlendedMegatronDatasetBuilder,
    build_gpt_datasets,
)
from asynctron.datasets.formats._blended import BlendedDataset
from asynctron.datasets.formats._blending import (
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from asynctron.datasets.formats._builder import IndexedDatasetBuilder, write_indexed_dataset
from asynctron.datasets.formats._config import GPTDatasetConfig
from asynctron.datasets.formats._gpt import GPTDataset
from asynctron.datasets.formats._indexed import DatasetIndex, IndexedDataset, optimal_dtype
from asynctron.datasets.formats._mock import MockGPTDataset, MockGPTLowLevelDataset
from asynctron.datasets.formats._prepare_cache import PreparedDataset, prepare_cache
from asynctron.datasets.formats._preprocess import PreprocessConfig, PreprocessResult, preprocess
from asynctron.datasets.formats._sample_index import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
)
from asynctron.datasets.formats._splits import Split
from asynctron.datasets.formats._tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer
from asynctron.datasets.loader._loader import AsyncLoader, collate
from asynctron.datasets.object_cache._object_storage import ObjectStorageConfig
from asynctron.datasets.object_cache._range_cache import ObjectCacheUsage, object_cache_usage

__all__ = [
    "AsyncLoader",
    "BlendedDataset",
    "BlendedMegatronDatasetBuilder",
    "ByteTokenizer",
    "DatasetIndex",
    "GPTDataset",
    "GPTDatasetConfig",
    "HFTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MockGPTDataset",
    "MockGPTLowLevelDataset",
    "ObjectCacheUsage",
    "ObjectStorageConfig",
    "PreparedDataset",
    "PreprocessConfig",
    "PreprocessResult",
    "Split",
    "build_blending_indices",
    "build_document_index",
    "build_exhaustive_blending_indices",
    "build_gpt_datasets",
    "build_sample_index",
    "build_shuffle_index",
    "collate",
    "load_tokenizer",
    "object_cache_usage",
    "optimal_dtype",
    "prepare_cache",
    "preprocess",
    "write_indexed_dataset",
]
