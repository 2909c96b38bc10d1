"""Fixtures for the dataset tests: small corpora on disk, and megatron-core when it imports."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Iterator
from typing import ClassVar

import numpy as np
import pytest

from asynctron.datasets import GPTDataset, GPTDatasetConfig, IndexedDataset, build_gpt_datasets
from asynctron.datasets.formats._builder import write_indexed_dataset
from asynctron.storage.backends import Backend, LocalBackend, register_backend


class Tok:
    """A tokenizer as megatron's datasets need one: eod, pad, vocab size, cache identity."""

    eod = 0
    pad = 1001
    vocab_size = 1002
    unique_identifiers: ClassVar[dict[str, str]] = {"class": "Tok"}


@pytest.fixture
def tok() -> Tok:
    return Tok()


@pytest.fixture(scope="session")
def megatron() -> types.SimpleNamespace:
    """megatron-core's dataset modules; the test is skipped (with the reason) where they do not
    import."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            from megatron.core.datasets import helpers, indexed_dataset
            from megatron.core.datasets.blended_megatron_dataset_builder import (
                BlendedMegatronDatasetBuilder,
            )
            from megatron.core.datasets.blended_megatron_dataset_config import (
                convert_split_vector_to_split_matrix,
                parse_and_normalize_split,
            )
            from megatron.core.datasets.gpt_dataset import (
                GPTDataset,
                GPTDatasetConfig,
                MockGPTDataset,
            )
            from megatron.core.datasets.utils import Split
    except Exception as exc:  # ImportError, or a broken build of helpers_cpp
        pytest.skip(f"megatron-core does not import here ({type(exc).__name__}: {exc}); "
                    "pip install megatron-core==0.16.1 for the parity tests")
    return types.SimpleNamespace(
        helpers=helpers, indexed_dataset=indexed_dataset, GPTDataset=GPTDataset,
        GPTDatasetConfig=GPTDatasetConfig, MockGPTDataset=MockGPTDataset,
        Builder=BlendedMegatronDatasetBuilder, Split=Split,
        parse_split=parse_and_normalize_split, split_matrix=convert_split_vector_to_split_matrix)


def random_documents(seed: int, num_documents: int, max_length: int = 300,
                     eod: int | None = None) -> list[np.ndarray]:
    """Token documents of random lengths (1..max_length), ids in 2..999, ending with `eod`."""
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(num_documents):
        tokens = rng.integers(2, 1000, size=int(rng.integers(1, max_length)))
        documents.append(np.append(tokens, eod) if eod is not None else tokens)
    return documents


@pytest.fixture
def serve_local_paths() -> Iterator[Callable[[Backend], None]]:
    """`serve_local_paths(backend)`: `backend_for` gives `backend` for every local path (a
    fault-injecting or recording one) until the test ends, then a fresh `LocalBackend`."""
    yield lambda backend: register_backend("file", lambda: backend)
    register_backend("file", LocalBackend)


@pytest.fixture
def make_corpus(tmp_path) -> Callable[..., IndexedDataset]:
    """`make_corpus(name, seed=0, num_documents=300, dtype=np.uint16, eod=None)` writes a
    corpus under tmp_path and opens it."""

    def make(name: str, seed: int = 0, num_documents: int = 300, dtype: object = np.uint16,
             eod: int | None = None, max_length: int = 300) -> IndexedDataset:
        documents = random_documents(seed, num_documents, max_length, eod)
        return write_indexed_dataset(str(tmp_path / name), documents, dtype=dtype)

    return make


@pytest.fixture
def tokenizer_json(tmp_path) -> str:
    """A tiny word-level HuggingFace tokenizer.json, trained here (nothing downloaded):
    [UNK]=0, <|endoftext|>=1, [PAD]=2, then 8 words."""
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is missing")
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>", "[PAD]"])
    tokenizer.train_from_iterator(["the cat sat on the mat", "a dog ran"], trainer)
    path = str(tmp_path / "tokenizer.json")
    tokenizer.save(path)
    return path


@pytest.fixture
def gpt(make_corpus, tmp_path, tok) -> GPTDataset:
    """One epoch of a 150-document corpus, 32-token samples (cached under tmp_path)."""
    prefix = make_corpus("g", num_documents=150, eod=0).path_prefix
    config = GPTDatasetConfig(random_seed=5, sequence_length=32, tokenizer=tok,
                              blend=([prefix], None), split="1",
                              path_to_cache=str(tmp_path / "cache"))
    dataset = build_gpt_datasets(config, [None, None, None])[0]
    assert isinstance(dataset, GPTDataset)
    return dataset


@pytest.fixture
def blended(make_corpus, tmp_path, tok):
    """A 200-sample blend of two corpora, weights 1:3, 32-token samples."""
    prefixes = [make_corpus(name, seed=k, num_documents=150, eod=0).path_prefix
                for k, name in enumerate("ab")]
    config = GPTDatasetConfig(random_seed=5, sequence_length=32, tokenizer=tok,
                              blend=(prefixes, [1.0, 3.0]), split="1",
                              path_to_cache=str(tmp_path / "cache"))
    return build_gpt_datasets(config, [200, 0, 0])[0]
