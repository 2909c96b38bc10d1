"""Megatron-LM's own subclasses of `GPTDatasetConfig`, defined on asynctron's config.

megatron-core's `megatron/core/datasets/multimodal_dataset.py` (the wheel's) and Megatron-LM's
`megatron/training/datasets/fim_dataset.py` (copied here, README.md) are imported at collection,
with the swap applied: their class bodies subclass asynctron's `GPTDatasetConfig` (and
`MockGPTDataset`, `GPTDataset`), as in a megatron job that runs on asynctron.
`test_mock_multimodal_dataset` is upstream's test of the same name (test_multimodal_dataset.py),
on one rank.
"""

from __future__ import annotations

import megatron.core.datasets.blended_megatron_dataset_builder as megatron_builder
import megatron.core.datasets.gpt_dataset as megatron_gpt
import numpy as np
import pytest
import torch
from megatron.core.datasets.multimodal_dataset import (
    MockMultimodalDataset,
    MultimodalDatasetConfig,
)
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.training.tokenizer.tokenizer import _NullTokenizer
from megatron_swap import REFERENCE

import asynctron.datasets as ours

pytestmark = pytest.mark.skipif(REFERENCE, reason="checks the swap; reference runs megatron")


def test_megatrons_config_subclasses_extend_asynctron_classes() -> None:
    assert MultimodalDatasetConfig.__mro__[1] is ours.GPTDatasetConfig
    assert GPTFIMDatasetConfig.__mro__[1] is ours.GPTDatasetConfig
    assert MockMultimodalDataset.__mro__[1] is ours.MockGPTDataset
    assert GPTFIMDataset.__mro__[1] is ours.GPTDataset


def test_mock_multimodal_dataset() -> None:
    config = MultimodalDatasetConfig(
        random_seed=1234, sequence_length=1024, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=True, image_h=336, image_w=336,
        split="990,9,1", tokenizer=_NullTokenizer(vocab_size=8192),
        mid_level_dataset_surplus=0.005)
    datasets = megatron_builder.BlendedMegatronDatasetBuilder(
        MockMultimodalDataset, [100, 100, 100], lambda: True, config).build()
    for ds in datasets:
        assert type(ds) is MockMultimodalDataset and ds.config is config
        sample = ds[0]
        assert sample["image"].shape == torch.Size([3, 336, 336])
        assert sample["tokens"].shape == (1024,)
    with pytest.raises(AssertionError):  # megatron's own check, after asynctron's
        MultimodalDatasetConfig(random_seed=1, sequence_length=8, image_w=2)


def test_fim_config_builds_asynctron_gpt_datasets(tmp_path) -> None:
    prefix = str(tmp_path / "fim")
    rng = np.random.default_rng(0)
    with ours.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        for _ in range(100):
            document = np.append(rng.integers(2, 1000, size=int(rng.integers(1, 200))), 1000)
            builder.add_document(document, [len(document)])
        builder.finalize(prefix + ".idx")
    extra_tokens = {"prefix": "<prefix>", "middle": "<middle>", "suffix": "<suffix>",
                    "pad": "<pad>", "eod": "<eod>"}
    # upstream's test_fim_dataset config, on a local corpus and tokenizer
    config = GPTFIMDatasetConfig(
        blend=([prefix], None), random_seed=1234, sequence_length=32, split="8,1,1",
        tokenizer=_NullTokenizer(vocab_size=1000), reset_position_ids=True,
        reset_attention_mask=True, eod_mask_loss=True, fim_extra_tokens=extra_tokens,
        fim_rate=1.0, fim_spm_rate=0.5, fim_fragment_rate=1.0, fim_split_sample=None)
    assert (config.fim_rate, config.fim_no_prefix, config.eod) == (1.0, None, 1000)
    datasets = megatron_builder.BlendedMegatronDatasetBuilder(
        megatron_gpt.GPTDataset, [40, 4, 4], lambda: True, config).build()
    for ds in datasets:
        assert type(ds) is ours.GPTDataset and ds.config is config
        assert ds[0]["tokens"].shape == (32,)
