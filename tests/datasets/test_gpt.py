"""GPTDataset: megatron-core's indices and samples, bit for bit; the index cache."""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from asynctron.datasets import GPTDataset, GPTDatasetConfig, IndexedDataset, Split
from asynctron.errors import CorruptDatasetError


def _config(tok: Any, cache: str | None, **options: Any) -> GPTDatasetConfig:
    return GPTDatasetConfig(random_seed=1234, sequence_length=options.pop("length", 64),
                            tokenizer=tok, path_to_cache=cache, **options)


def _ours(ds: IndexedDataset, num_samples: int | None, tok: Any, cache: str | None = None,
          split: Split = Split.train, **options: Any) -> GPTDataset:
    indices = np.arange(len(ds), dtype=np.int32)
    return GPTDataset(ds, ds.path_prefix, indices, num_samples, split,
                      _config(tok, cache, **options))


def _theirs(megatron, ds: IndexedDataset, num_samples: int | None, tok: Any, cache: str,
            split: Split = Split.train, **options: Any):
    flags = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False}
    flags.update(options)
    config = megatron.GPTDatasetConfig(
        random_seed=1234, sequence_length=flags.pop("length", 64), tokenizer=tok,
        path_to_cache=cache, **flags)
    low_level = megatron.indexed_dataset.IndexedDataset(ds.path_prefix)
    indices = np.arange(len(ds), dtype=np.int32)
    return megatron.GPTDataset(low_level, ds.path_prefix, indices, num_samples,
                               megatron.Split[split.name], config)


def assert_same_dataset(theirs: Any, ours: Any, num_checked: int = 40) -> None:
    """Same indices (values, dtypes, shapes) and bit-identical samples."""
    for name in ("document_index", "sample_index", "shuffle_index"):
        expected, found = np.asarray(getattr(theirs, name)), np.asarray(getattr(ours, name))
        assert found.dtype == expected.dtype, name
        assert found.shape == expected.shape, name
        assert np.array_equal(found, expected), name
    assert len(ours) == len(theirs)
    picks = sorted({*range(min(num_checked, len(ours))), len(ours) - 1,
                    *np.random.default_rng(0).integers(0, len(ours), num_checked).tolist()})
    for i in [*picks, None]:
        expected, found = theirs[i], ours[i]
        assert list(found) == list(expected), i
        for key in expected:
            assert found[key].dtype == expected[key].dtype, (i, key)
            assert found[key].shape == expected[key].shape, (i, key)
            assert torch.equal(found[key], expected[key]), (i, key)


#: num_samples in epochs of the corpus (None: one epoch, megatron's default)
CASES = {
    "one epoch": {"epochs": None},
    "part of an epoch": {"epochs": 0.3},
    "many epochs": {"epochs": 7.9},
    "separate final epoch": {"epochs": 3.3},  # the last epoch gives < 80 % of an epoch
    "joint final epoch": {"epochs": 2.9},
    "no extra token": {"epochs": 3.3, "add_extra_token_to_sequence": False},
    "valid, partial last sample": {"epochs": None, "split": Split.valid,
                                   "drop_last_partial_validation_sequence": False},
    "resetting masks": {"epochs": 0.5, "reset_position_ids": True,
                        "reset_attention_mask": True, "eod_mask_loss": True},
    "no attention mask": {"epochs": 0.5, "create_attention_mask": False,
                          "reset_position_ids": True},
    "no extra token, resetting": {"epochs": 1.5, "add_extra_token_to_sequence": False,
                                  "eod_mask_loss": True, "length": 33},
}


@pytest.mark.parametrize("case", list(CASES))
def test_indices_and_samples_are_megatrons(megatron, make_corpus, tmp_path, tok,
                                           case: str) -> None:
    options = dict(CASES[case])
    epochs = options.pop("epochs")
    ds = make_corpus("corpus", num_documents=200, eod=0)
    per_epoch = int(ds.sequence_lengths.sum()) // options.get("length", 64)
    num_samples = None if epochs is None else int(epochs * per_epoch)
    theirs = _theirs(megatron, ds, num_samples, tok, str(tmp_path / "theirs"), **options)
    ours = _ours(ds, num_samples, tok, str(tmp_path / "ours"), **options)
    assert_same_dataset(theirs, ours)
    if epochs in (3.3, 2.9):  # is the final epoch shuffled apart from the others?
        extra = int(options.get("add_extra_token_to_sequence", True))
        before_final = (3 * ours.num_tokens_per_epoch - extra) // 64 if epochs == 3.3 else (
            (2 * ours.num_tokens_per_epoch - extra) // 64)
        tail = np.asarray(ours.shuffle_index)[before_final:]
        apart = bool(tail.min() >= before_final)
        assert apart == (epochs == 3.3)


def test_cache_is_mapped_and_reused(make_corpus, tmp_path, tok) -> None:
    ds = make_corpus("corpus")
    cache = str(tmp_path / "cache")
    first = _ours(ds, 500, tok, cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and files[0].endswith("-GPTDataset-train-description.txt")
    second = _ours(ds, 500, tok, cache)
    assert not second.sample_index.flags.writeable  # mapped read-only, not rebuilt
    assert np.array_equal(first.shuffle_index, second.shuffle_index)
    assert sorted(os.listdir(cache)) == files


def test_default_cache_lives_beside_the_data_like_megatron(make_corpus, tok) -> None:
    ds = make_corpus("corpus")
    _ours(ds, 10, tok)
    assert os.listdir(os.path.join(ds.path_prefix, "cache", "GPTDataset_indices"))


def test_cache_key_covers_the_extra_token(megatron, make_corpus, tmp_path, tok) -> None:
    """megatron-core's key omits add_extra_token_to_sequence, so its second dataset silently
    reuses the first one's indices; ours builds new ones."""
    ds = make_corpus("corpus")
    cache = str(tmp_path / "shared")
    _theirs(megatron, ds, 700, tok, cache, add_extra_token_to_sequence=True)
    stale = _theirs(megatron, ds, 700, tok, cache, add_extra_token_to_sequence=False)
    fresh = _theirs(megatron, ds, 700, tok, str(tmp_path / "fresh"),
                    add_extra_token_to_sequence=False)
    assert not np.array_equal(stale.sample_index, fresh.sample_index)  # megatron's bug
    _ours(ds, 700, tok, cache, add_extra_token_to_sequence=True)
    ours = _ours(ds, 700, tok, cache, add_extra_token_to_sequence=False)
    assert np.array_equal(ours.sample_index, fresh.sample_index)


def test_cache_key_covers_the_data(make_corpus, tmp_path, tok) -> None:
    cache = str(tmp_path / "cache")
    first = _ours(make_corpus("corpus", seed=1), 50, tok, cache)
    second = _ours(make_corpus("corpus", seed=2), 50, tok, cache)  # same path, new content
    assert first.unique_description_hash != second.unique_description_hash


def test_corrupt_cache_file_is_named(make_corpus, tmp_path, tok) -> None:
    ds = make_corpus("corpus")
    cache = str(tmp_path / "cache")
    built = _ours(ds, 300, tok, cache)
    path = os.path.join(cache, f"{built.unique_description_hash}-GPTDataset-train-sample_index.npy")
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CorruptDatasetError, match=rf"^cached index {re.escape(path)}: expected "
                                                  r"a readable \.npy, found .*; delete the file "
                                                  r"to rebuild it$"):
        _ours(ds, 300, tok, cache)
    np.save(path, np.zeros((3, 3), np.float32))
    with pytest.raises(CorruptDatasetError, match=r"expected dtype in \['int32', 'int64'\] with 2 "
                                                  r"dimensions, found float32 \(3, 3\)"):
        _ours(ds, 300, tok, cache)


def test_an_incomplete_cache_entry_is_rebuilt(make_corpus, tmp_path, tok) -> None:
    ds = make_corpus("corpus")
    cache = str(tmp_path / "cache")
    built = _ours(ds, 300, tok, cache)
    stem = f"{built.unique_description_hash}-GPTDataset-train"
    os.remove(os.path.join(cache, f"{stem}-description.txt"))
    again = _ours(ds, 300, tok, cache)
    assert np.array_equal(again.sample_index, built.sample_index)


def test_pad_id_colliding_with_eod_falls_back_like_megatron(make_corpus, tok) -> None:
    class Collides:
        eod = 0
        pad = 0

    ds = make_corpus("corpus")
    with pytest.warns(UserWarning, match=r"^pad id 0 equals another special token id; using -1"):
        dataset = _ours(ds, 10, Collides())
    assert dataset.pad_id == -1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _ours(ds, 10, tok).pad_id == 1001


def test_config_errors() -> None:
    with pytest.raises(ValueError, match=r"^sequence_length: expected >= 2, found 1$"):
        GPTDatasetConfig(random_seed=1, sequence_length=1)
    with pytest.raises(ValueError, match=r"^eod_id: expected an end-of-document id"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, eod_mask_loss=True)
    with pytest.raises(ValueError, match=r"^split: expected a split string"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["a"], None))
    with pytest.raises(ValueError, match=r"^blend: expected one weight per prefix \(2\), found 1"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["a", "b"], [1.0]), split="1")
    with pytest.raises(ValueError, match=r"^blend_per_split: expected neither blend nor split"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, split="1",
                         blend_per_split=[None, None, None])


def test_too_few_tokens(make_corpus, tmp_path, tok) -> None:
    ds = make_corpus("tiny", num_documents=1, max_length=2)
    with pytest.raises(ValueError, match=r"split train: expected at least 2 tokens, found 1;"):
        _ours(ds, 3, tok, str(tmp_path / "cache"))


@pytest.mark.parametrize("split", [Split.train, Split.valid])
def test_deferred_indices_are_counted_without_mapping_and_must_be_cached(
        make_corpus, tmp_path, tok, split: Split) -> None:
    ds = make_corpus("corpus")
    cache = str(tmp_path / "cache")
    options = {"drop_last_partial_validation_sequence": False}
    with pytest.raises(FileNotFoundError, match=r"-description.txt: expected the complete "):
        _ = _ours(ds, 700, tok, cache, split, defer_npy_index_mmap=True, **options).sample_index
    built = _ours(ds, 700, tok, cache, split, **options)
    deferred = _ours(ds, 700, tok, cache, split, defer_npy_index_mmap=True, **options)
    assert deferred._arrays is None and len(deferred) == len(built)
    assert deferred._arrays is None  # counting mapped nothing
    assert np.array_equal(deferred.shuffle_index, built.shuffle_index)
    fast = _ours(ds, 700, tok, cache, split, fast_cache_load=True, **options)
    assert np.array_equal(fast.sample_index, built.sample_index)


def test_the_tokenizers_dtype_is_checked_only_with_sequences_per_dataset(make_corpus,
                                                                          tok) -> None:
    """megatron checks the token dtype against the vocabulary only beside
    sequences_per_dataset; an int32 corpus with a small vocabulary builds otherwise."""
    ds = make_corpus("wide", dtype=np.int32)
    config = GPTDatasetConfig(random_seed=1, sequence_length=16, tokenizer=tok)
    assert GPTDataset.build_low_level_dataset(ds.path_prefix, config).dtype == np.int32
    strict = GPTDatasetConfig(random_seed=1, sequence_length=16, tokenizer=tok,
                              sequences_per_dataset={ds.path_prefix: (len(ds),
                                                                      ds.num_documents + 1)})
    with pytest.raises(CorruptDatasetError, match=r"expected token dtype code 8, found 4"):
        GPTDataset.build_low_level_dataset(ds.path_prefix, strict)
