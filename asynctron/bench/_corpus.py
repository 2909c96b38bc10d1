"""The benchmarks' token corpus, its tokenizer, and megatron-core's dataset modules (the peer
the data benchmarks run beside asynctron), shared by the local and the object-store runs."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from asynctron.datasets import IndexedDatasetBuilder


class BenchTokenizer:
    """The tokenizer the benchmarks' GPT datasets name (only its ids are used)."""

    eod = 0
    pad = 65535
    vocab_size = 50_000
    unique_identifiers = {"class": "bench"}  # noqa: RUF012


def megatron_modules() -> tuple[Any, str | None]:
    """megatron-core's dataset modules, or None and why they cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import gpt_dataset, helpers, indexed_dataset
            from megatron.core.datasets.utils import Split as MegatronSplit
    except Exception as exc:  # ImportError or a broken helpers build
        return None, f"{type(exc).__name__}: {exc}"
    return {"helpers": helpers, "gpt": gpt_dataset, "indexed": indexed_dataset,
            "Split": MegatronSplit}, None


def write_corpus(prefix: str, num_tokens: int, seed: int, sparse: bool = False) -> None:
    """Documents of 1..2000 tokens (uint16, eod-terminated) up to `num_tokens`. With `sparse`
    the .bin is a hole of the right size (for index builds, which read only the .idx)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2000, size=num_tokens // 1000 + 1, dtype=np.int32)
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), num_tokens)) + 1]
    if sparse:
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        builder._lengths.extend(lengths)  # index only; the tokens are a hole below
        builder._documents.extend(np.arange(1, lengths.size + 1))
        builder.finalize(prefix + ".idx")
        os.truncate(prefix + ".bin", int(lengths.sum(dtype=np.int64)) * 2)
        return
    with IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16) as builder:
        step = 1 << 15  # documents per chunk of random tokens (~32 M tokens, 64 MiB)
        for first in range(0, lengths.size, step):
            chunk = lengths[first:first + step]
            ends = np.cumsum(chunk, dtype=np.int64)
            tokens = rng.integers(1, 50_000, size=int(ends[-1]), dtype=np.uint16)
            tokens[ends - 1] = 0  # every document ends with eod
            for start, end in zip((ends - chunk).tolist(), ends.tolist(), strict=True):
                builder.add_item(tokens[start:end])
                builder.end_document()
        builder.finalize(prefix + ".idx")
