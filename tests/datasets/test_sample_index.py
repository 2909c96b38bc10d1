"""The index builds are megatron-core's arrays, dtype included: tested against its C++ helper
and its Python functions, on random and edge-case inputs."""

from __future__ import annotations

import numpy as np
import pytest

from asynctron.datasets import build_document_index, build_sample_index, build_shuffle_index
from asynctron.datasets.formats import _sample_index
from asynctron.datasets.formats._sample_index import num_samples_of, sample_index_dtype


def _cases(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for trial in range(count):
        num_documents = int(rng.integers(1, 60))
        low = 0 if trial % 4 == 0 else 1  # empty sequences sometimes
        sizes = rng.integers(low, int(rng.integers(2, 400)), size=num_documents).astype(np.int32)
        if sizes.sum() < 2:
            continue
        num_epochs = int(rng.integers(1, 4))
        document_index = np.tile(np.arange(num_documents, dtype=np.int32), num_epochs)
        rng.shuffle(document_index)
        sequence_length = int(rng.integers(2, 80))
        yield sizes, document_index, sequence_length, num_epochs, int(sizes.sum())


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("extra", [True, False])
def test_sample_index_is_megatrons(megatron, drop_last: bool, extra: bool) -> None:
    checked = 0
    for sizes, document_index, length, epochs, tokens in _cases(1 + 2 * drop_last + extra, 150):
        try:
            expected = megatron.helpers.build_sample_idx(sizes, document_index, length, epochs,
                                                         tokens, drop_last, extra)
        except AssertionError:  # megatron's own range check refuses a few empty-sequence cases
            continue
        found = build_sample_index(sizes, document_index, length, epochs, tokens, drop_last,
                                   extra)
        assert found.dtype == expected.dtype == np.int32
        assert found.shape == expected.shape
        assert np.array_equal(found, expected), (sizes, document_index, length)
        checked += 1
    assert checked > 100


def test_chunk_boundaries_do_not_matter(megatron, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny chunks put every document and row boundary on a chunk edge somewhere."""
    monkeypatch.setattr(_sample_index, "_CHUNK_DOCUMENTS", 3)
    monkeypatch.setattr(_sample_index, "_CHUNK_ROWS", 2)
    for sizes, document_index, length, epochs, tokens in _cases(99, 60):
        for extra in (True, False):
            try:
                expected = megatron.helpers.build_sample_idx(sizes, document_index, length,
                                                             epochs, tokens, True, extra)
            except AssertionError:
                continue
            found = build_sample_index(sizes, document_index, length, epochs, tokens, True,
                                       extra)
            assert np.array_equal(found, expected)


def test_single_precision_rounding_of_a_partial_last_sample(megatron) -> None:
    """megatron's C++ counts samples as ceil(float(tokens) / length) in float32: 2**24 + 1
    usable tokens round down to 2**24, one sample fewer than exact arithmetic."""
    sizes = np.array([2**24 + 2], np.int32)
    document_index = np.array([0], np.int32)
    assert num_samples_of(2**24 + 2, 2, False, True) == 2**23
    expected = megatron.helpers.build_sample_idx(sizes, document_index, 2, 1, 2**24 + 2,
                                                 False, True)
    found = build_sample_index(sizes, document_index, 2, 1, 2**24 + 2, False, True)
    assert found.shape == expected.shape == (2**23 + 1, 2)
    assert np.array_equal(found, expected)


def test_int64_when_indices_do_not_fit_int32() -> None:
    """megatron's rule: int64 once the document index is longer than int32 (checked without
    allocating 2**31 entries)."""
    sizes = np.array([5], np.int32)
    long_index = np.broadcast_to(np.zeros(1, np.int32), (2**31,))
    assert sample_index_dtype(sizes, long_index) == np.int64
    assert sample_index_dtype(sizes, np.zeros(2**31 - 1, np.int8)[:10]) == np.int32
    assert sample_index_dtype(np.array([2**31 - 1], np.int32), np.zeros(3, np.int32)) == np.int32


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"^sample index: expected sequence_length >= 2, "):
        build_sample_index(np.array([5], np.int32), np.array([0], np.int32), 1, 1, 5)


def _megatron_gpt_module(megatron):
    import sys

    return sys.modules[megatron.GPTDataset.__module__]


@pytest.mark.parametrize(("epochs", "separate"), [(1, False), (3, False), (3, True), (1, True)])
def test_document_and_shuffle_index_are_megatrons(megatron, epochs: int, separate: bool) -> None:
    gpt = _megatron_gpt_module(megatron)
    documents = np.arange(17, 140, dtype=np.int32)
    ours = build_document_index(documents, epochs, np.random.RandomState(5), separate)
    theirs = gpt._build_document_index(documents, epochs, np.random.RandomState(5), separate)
    assert ours.dtype == theirs.dtype == np.int32 and np.array_equal(ours, theirs)
    for num_samples, total in ((100, 100), (80, 100), (0, 5)):
        ours = build_shuffle_index(num_samples, total, np.random.RandomState(9))
        theirs = gpt._build_shuffle_index(num_samples, total, np.random.RandomState(9))
        assert ours.dtype == theirs.dtype == np.uint32 and np.array_equal(ours, theirs)
