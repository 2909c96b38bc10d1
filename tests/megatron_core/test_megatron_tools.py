"""Megatron-LM's tools on asynctron's classes, and proof that the suite here runs on them.

`test_preprocess_data_gpt` (upstream) needs GPT-2's vocabulary from the hub; here the same
checks (`do_test_preprocess_data`: tools/preprocess_data.py builds .bin/.idx files,
tools/merge_datasets.py merges them, every document decodes back to its text from both) run
with a byte-level GPT-2 vocabulary made on the spot: 256 byte tokens and no merges, which
megatron's GPT2BPETokenizer reads like any other.
"""

from __future__ import annotations

import json
import os
from argparse import Namespace

import megatron.core.datasets.blended_megatron_dataset_builder as megatron_builder
import megatron.core.datasets.gpt_dataset as megatron_gpt
import megatron.core.datasets.indexed_dataset as megatron_indexed
import numpy as np
import pytest
import tools.merge_datasets
import tools.preprocess_data
from megatron.training.tokenizer.gpt2_tokenization import bytes_to_unicode
from megatron.training.tokenizer.tokenizer import _NullTokenizer
from megatron_swap import REFERENCE, swaps
from unit_tests.data import test_builder, test_gpt_dataset
from unit_tests.data.test_preprocess_data import do_test_preprocess_data

import asynctron.datasets as ours

pytestmark = pytest.mark.skipif(REFERENCE, reason="checks the swap; reference runs megatron")


def test_the_suite_and_the_tools_see_asynctron_classes() -> None:
    for (module, name), replacement in swaps().items():
        assert getattr(module, name) is replacement, f"{module.__name__}.{name}"
    assert test_builder.GPTDataset is ours.GPTDataset
    assert test_builder.BlendedDataset is ours.BlendedDataset
    assert test_builder.BlendedMegatronDatasetBuilder is ours.BlendedMegatronDatasetBuilder
    assert test_builder.IndexedDatasetBuilder is ours.IndexedDatasetBuilder
    assert test_gpt_dataset.MockGPTDataset is ours.MockGPTDataset
    assert tools.merge_datasets.IndexedDataset is ours.IndexedDataset
    assert tools.preprocess_data.indexed_dataset.IndexedDatasetBuilder is (
        ours.IndexedDatasetBuilder)


def test_the_builder_builds_asynctron_datasets() -> None:
    config = megatron_gpt.GPTDatasetConfig(
        random_seed=1, sequence_length=64, split="8,1,1",
        tokenizer=_NullTokenizer(vocab_size=1000), mid_level_dataset_surplus=0.005)
    built = megatron_builder.BlendedMegatronDatasetBuilder(
        megatron_gpt.MockGPTDataset, [10, 10, 10], lambda: True, config).build()
    assert all(type(ds) is ours.MockGPTDataset for ds in built)
    assert type(built[0].dataset) is ours.MockGPTLowLevelDataset


def byte_level_gpt2_vocab(directory: str) -> tuple[str, str]:
    """A GPT-2 vocabulary of the 256 byte tokens and no merges: `(vocab.json, merges.txt)`."""
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    vocab_path = os.path.join(directory, "vocab.json")
    merges_path = os.path.join(directory, "merges.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(merges_path, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return vocab_path, merges_path


def test_preprocess_and_merge_with_megatron_tools(tmp_path) -> None:
    vocab, merges = byte_level_gpt2_vocab(str(tmp_path))
    work = tmp_path / "work"
    work.mkdir()
    do_test_preprocess_data(str(work), extra_args=[
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
        "--append-eod", "--workers", "2", "--log-interval", "1", "--legacy-tokenizer"])
    merged = ours.IndexedDataset(str(work / "sample_data" / "merge"))
    assert len(merged) > 0 and merged.dtype == np.uint16  # 257 tokens: uint16, as megatron


def test_build_sequences_per_dataset_reads_asynctron_indices(tmp_path) -> None:
    from tools.build_sequences_per_dataset import build_sequences_per_dataset

    prefix = str(tmp_path / "d")
    with ours.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        for n in (3, 5, 7):
            builder.add_document(np.arange(n), [n])
        builder.finalize(prefix + ".idx")
    args = Namespace(data_path=[prefix], data_args_path=None, train_data_path=None,
                     valid_data_path=None, test_data_path=None, per_split_data_args_path=None)
    assert build_sequences_per_dataset(args) == {prefix: (3, 4)}
    assert isinstance(megatron_indexed._IndexReader(prefix + ".idx", False), ours.DatasetIndex)
