"""build_gpt_datasets and BlendedDataset: the train/valid/test datasets megatron-core's
BlendedMegatronDatasetBuilder builds, sample for sample."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from asynctron.datasets import (
    BlendedDataset,
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    build_gpt_datasets,
)


@pytest.fixture
def corpora(make_corpus) -> list[str]:
    return [make_corpus(name, seed=seed, num_documents=120, eod=0).path_prefix
            for seed, name in enumerate("abc")]


def _assert_same(theirs: Any, ours: Any) -> None:
    assert (theirs is None) == (ours is None)
    if ours is None:
        return
    assert type(ours).__name__ == type(theirs).__name__
    assert len(ours) == len(theirs)
    if isinstance(ours, BlendedDataset):
        for name in ("dataset_index", "dataset_sample_index"):
            expected, found = getattr(theirs, name), getattr(ours, name)
            assert found.dtype == expected.dtype and np.array_equal(found, expected), name
    for i in sorted({*range(min(25, len(ours))), len(ours) - 1}):
        expected, found = theirs[i], ours[i]
        assert list(found) == list(expected)
        for key, value in expected.items():
            if key == "dataset_id":
                assert type(found[key]) is type(value) and found[key] == value
            else:
                assert found[key].dtype == value.dtype and torch.equal(found[key], value), key


BLENDS = {
    "weighted blend": lambda p: {"blend": (p, [0.3, 0.5, 0.2]), "split": "90,8,2"},
    "blend by length": lambda p: {"blend": (p[:2], None), "split": "90,8,2"},
    "one dataset": lambda p: {"blend": (p[:1], None), "split": "90,8,2"},
    "per split": lambda p: {"blend_per_split": [(p[:2], [1.0, 2.0]), (p[2:], None), None]},
    # one weighted prefix in a split: megatron builds a plain dataset of exactly that size
    "per split, one weighted prefix": lambda p: {
        "blend_per_split": [(p[:1], [0.7]), (p[1:2], [1.0]), (p[2:], None)]},
    "pread reads": lambda p: {"blend": (p, [0.3, 0.5, 0.2]), "split": "90,8,2",
                              "mmap_bin_files": False},
}
SIZES = {"sized": [900, 60, 10], "one epoch": [None, None, None]}


# weighted blends need sizes (megatron asserts that too)
COMBINATIONS = [(b, s) for b in BLENDS for s in SIZES
                if s == "sized" or b in ("blend by length", "one dataset")]


@pytest.mark.parametrize(("blend", "sizes"), COMBINATIONS)
def test_splits_are_megatrons(megatron, corpora, tmp_path, tok, blend: str, sizes: str) -> None:
    options = BLENDS[blend](corpora)
    wanted = SIZES[sizes]
    config = megatron.GPTDatasetConfig(
        random_seed=3, sequence_length=32, tokenizer=tok, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, **options)
    theirs = megatron.Builder(megatron.GPTDataset, wanted, lambda: True, config).build()
    ours = build_gpt_datasets(GPTDatasetConfig(
        random_seed=3, sequence_length=32, tokenizer=tok, path_to_cache=str(tmp_path / "cache"),
        **options), wanted)
    for expected, found in zip(theirs, ours, strict=True):
        _assert_same(expected, found)


def test_blended_indices_are_cached(corpora, tmp_path, tok) -> None:
    config = GPTDatasetConfig(random_seed=3, sequence_length=32, tokenizer=tok,
                              path_to_cache=str(tmp_path / "cache"),
                              blend=(corpora, [1.0, 1.0, 2.0]), split="1")
    first = build_gpt_datasets(config, [500, 0, 0])[0]
    second = build_gpt_datasets(config, [500, 0, 0])[0]
    assert isinstance(second, BlendedDataset)
    assert not second.dataset_index.flags.writeable  # loaded from the cache map
    assert np.array_equal(first.dataset_index, second.dataset_index)


def test_a_blend_that_oversamples_names_the_dataset(corpora, tmp_path, tok) -> None:
    config = GPTDatasetConfig(random_seed=3, sequence_length=32, tokenizer=tok,
                              path_to_cache=str(tmp_path / "cache"), blend=(corpora[:2], None),
                              split="1")
    datasets = [d for d in build_gpt_datasets(config, [None, 0, 0])[0].datasets]
    with pytest.raises(ValueError, match=r"^blend train: expected at most \d+ samples from "
                                         r"dataset 0 \(.*a\), found \d+ requested; raise "
                                         r"mid_level_dataset_surplus"):
        BlendedDataset(datasets, [0.9, 0.1], 3 * len(datasets[0]), config)


def test_argument_errors(corpora, tok) -> None:
    config = GPTDatasetConfig(random_seed=3, sequence_length=32, tokenizer=tok,
                              blend=(corpora, [1.0, 1.0, 2.0]), split="1")
    with pytest.raises(ValueError, match=r"^sizes\[1\] \(valid\): expected a number of samples "
                                         r"with blend weights, found None$"):
        build_gpt_datasets(config, [10, None, None])
    with pytest.raises(ValueError, match=r"^sizes: expected 3"):
        build_gpt_datasets(config, [10])
    with pytest.raises(ValueError, match=r"^MockGPTDataset: expected config.tokenizer"):
        build_gpt_datasets(GPTDatasetConfig(random_seed=1, sequence_length=8), [1, 1, 1])
    single = build_gpt_datasets(GPTDatasetConfig(
        random_seed=3, sequence_length=32, tokenizer=tok, blend=(corpora[:1], None),
        split="1"), [None, None, None])
    assert isinstance(single[0], GPTDataset) and single[1] is None and single[2] is None


def test_mock_data_is_megatrons(megatron, tok) -> None:
    options = {"random_seed": 5, "sequence_length": 64, "split": "990,9,1", "tokenizer": tok}
    mock = megatron.MockGPTDataset
    theirs = megatron.Builder(mock, [200, 20, 20], lambda: True, megatron.GPTDatasetConfig(
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
        **options)).build()
    ours = BlendedMegatronDatasetBuilder(MockGPTDataset, [200, 20, 20], lambda: True,
                                         GPTDatasetConfig(
        reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
        **options)).build()
    for expected, found in zip(theirs, ours, strict=True):
        for name in ("document_index", "sample_index", "shuffle_index"):
            assert np.array_equal(getattr(found, name), getattr(expected, name)), name
        _assert_same(expected, found)
        assert np.array_equal(found.dataset.get(7, 3, 20), expected.dataset.get(7, 3, 20))


def test_weights_without_a_size_are_an_assertion_error_too(corpora, tok) -> None:
    config = GPTDatasetConfig(random_seed=3, sequence_length=32, tokenizer=tok,
                              blend_per_split=[(corpora[:2], [1.0, 2.0]), None, None])
    with pytest.raises(AssertionError, match=r"train\): expected a number of samples"):
        BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config)
