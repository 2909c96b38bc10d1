import os
import random
import sys
import tempfile
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any, Dict

import nltk
import pytest

try:
    import multistorageclient as msc
except ModuleNotFoundError:
    # Create mock msc module
    msc = ModuleType("multistorageclient")

    # Create mock types submodule
    types_module = ModuleType("multistorageclient.types")

    # Create Range class in types module
    class Range:
        def __init__(self, offset: int, size: int):
            self.offset = offset
            self.size = size

    # Add Range class to types module
    types_module.Range = Range  # type: ignore[attr-defined]

    # Add types submodule to msc
    msc.types = types_module

    # Register the mock module in sys.modules
    sys.modules[msc.__name__] = msc
    sys.modules[types_module.__name__] = types_module

from megatron.core.datasets.indexed_dataset import IndexedDataset, ObjectStorageConfig
from megatron.core.datasets.object_storage_utils import MSC_PREFIX, S3_PREFIX
from megatron_swap import REFERENCE, reads_with, upload_dataset
from unit_tests.data.test_preprocess_data import build_datasets, dummy_jsonl
from test_megatron_tools import byte_level_gpt2_vocab

##
# Mock multistorageclient module
##


def _msc_download_file(remote_path, local_path):
    remote_path = remote_path.removeprefix(MSC_PREFIX + "default")
    os.makedirs(os.path.dirname(local_path), exist_ok=True)
    os.system(f"cp {remote_path} {local_path}")


def _msc_resolve_storage_client(path):
    class StorageClient:
        def read(self, path, byte_range):
            with open(path, "rb") as f:
                f.seek(byte_range.offset)
                return f.read(byte_range.size)

    return StorageClient(), path.removeprefix(MSC_PREFIX + "default")


setattr(msc, "open", open)
setattr(msc, "download_file", _msc_download_file)
setattr(msc, "resolve_storage_client", _msc_resolve_storage_client)


@pytest.mark.flaky
@pytest.mark.flaky_in_dev
def test_bin_reader(s3_env):
    with tempfile.TemporaryDirectory() as temp_dir:
        # set the default nltk data path
        os.environ["NLTK_DATA"] = os.path.join(temp_dir, "nltk_data")
        nltk.data.path.append(os.environ["NLTK_DATA"])

        path_to_raws = os.path.join(temp_dir, "sample_raws")
        path_to_data = os.path.join(temp_dir, "sample_data")
        path_to_object_storage_cache = os.path.join(temp_dir, "object_storage_cache")
        os.mkdir(path_to_raws)
        os.mkdir(path_to_data)
        os.mkdir(path_to_object_storage_cache)

        # create the dummy resources
        dummy_jsonl(path_to_raws)

        # build the datasets
        gpt2_vocab, gpt2_merge = byte_level_gpt2_vocab(temp_dir)
        build_datasets(
            path_to_raws,
            path_to_data,
            extra_args=[
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                gpt2_vocab,
                "--merge-file",
                gpt2_merge,
                "--append-eod",
                "--workers",
                "10",
                "--log-interval",
                "1",
            ],
        )

        prefixes = set(
            [
                os.path.join(temp_dir, "sample_data", path.split(".")[0])
                for path in os.listdir(path_to_data)
                if path.endswith(".bin") or path.endswith(".idx")
            ]
        )

        for prefix in prefixes:
            indexed_dataset_file = IndexedDataset(prefix, multimodal=False, mmap=False)
            assert reads_with(indexed_dataset_file, "file")

            indexed_dataset_mmap = IndexedDataset(prefix, multimodal=False, mmap=True)
            assert reads_with(indexed_dataset_mmap, "mmap")

            if REFERENCE:  # asynctron serves s3:// only, not NVIDIA's msc://
                indexed_dataset_msc = IndexedDataset(
                    MSC_PREFIX + "default" + prefix,  # use the default profile to access the filesystem
                    multimodal=False,
                    mmap=False,
                    object_storage_config=ObjectStorageConfig(
                        path_to_idx_cache=path_to_object_storage_cache
                    ),
                )
                assert reads_with(indexed_dataset_msc, "msc")
            else:
                indexed_dataset_msc = indexed_dataset_file
            assert len(indexed_dataset_msc) == len(indexed_dataset_file)
            assert len(indexed_dataset_msc) == len(indexed_dataset_mmap)

            indexed_dataset_s3 = IndexedDataset(
                S3_PREFIX + upload_dataset(s3_env, prefix),
                multimodal=False,
                mmap=False,
                object_storage_config=ObjectStorageConfig(
                    path_to_idx_cache=path_to_object_storage_cache
                ),
            )
            assert reads_with(indexed_dataset_s3, "s3")

            assert len(indexed_dataset_s3) == len(indexed_dataset_file)
            assert len(indexed_dataset_s3) == len(indexed_dataset_mmap)

            indices = random.sample(
                list(range(len(indexed_dataset_s3))), min(100, len(indexed_dataset_s3))
            )

            for idx in indices:
                assert (indexed_dataset_s3[idx] == indexed_dataset_file[idx]).all()
                assert (indexed_dataset_s3[idx] == indexed_dataset_mmap[idx]).all()


if __name__ == "__main__":
    test_bin_reader()
