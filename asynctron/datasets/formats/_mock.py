"""Mock GPT data: megatron-core's `MockGPTLowLevelDataset` and `MockGPTDataset`, sample for
sample.

Sequence `i` has `lengths[i]` tokens (lengths drawn once by `numpy.random.default_rng(0)`
from [1, 4096)), `1, 2, ..., length - 1` modulo the vocabulary, then the end-of-document id;
nothing is stored but the lengths: tokens are computed where a sample reads them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asynctron.datasets.formats._config import GPTDatasetConfig
from asynctron.datasets.formats._gpt import GPTDataset
from asynctron.datasets.formats._splits import Split


class MockGPTLowLevelDataset:
    """Megatron's mock token sequences, with the reads `GPTDataset` makes of an
    `IndexedDataset` (`sequence_lengths`, `sequence_pointers`, `gather`)."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = int(tokenizer.vocab_size)
        self.eod_token = int(tokenizer.eod)
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length,
                                             size=self.size, dtype=np.int32)
        self.dtype = np.dtype(np.int64)
        #: where each sequence starts in the virtual token stream, in bytes of `dtype`
        self.sequence_pointers = np.zeros(self.size, np.int64)
        np.cumsum(self.sequence_lengths[:-1], out=self.sequence_pointers[1:])
        self._starts = self.sequence_pointers.copy()
        self.sequence_pointers *= self.dtype.itemsize
        self.document_indices = np.arange(self.size + 1, dtype=np.int64)
        self.num_documents = self.size
        self.tokens = None  # nothing mapped: no pages to prefetch

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        return np.concatenate([(np.arange(length - 1) + 1) % self.vocab_size,
                               [self.eod_token]]).astype(np.int64)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset:offset + length]

    def gather(self, starts: np.ndarray, counts: np.ndarray, out: np.ndarray,
               destinations: np.ndarray) -> None:
        """As `IndexedDataset.gather`: runs of the virtual token stream into the flat `out`."""
        flat = out.reshape(-1)
        for start, count, destination in zip(starts.tolist(), counts.tolist(),
                                             destinations.tolist(), strict=True):
            positions = np.arange(start, start + count, dtype=np.int64)
            sequence = np.searchsorted(self._starts, positions, side="right") - 1
            offset = positions - self._starts[sequence]
            last = offset == self.sequence_lengths[sequence] - 1
            flat[destination:destination + count] = np.where(
                last, self.eod_token, (offset + 1) % self.vocab_size)


class MockGPTDataset(GPTDataset):
    """A `GPTDataset` over `MockGPTLowLevelDataset`; built by `BlendedMegatronDatasetBuilder`
    when the config has no blend (`config.mock`)."""

    def __init__(self, dataset: MockGPTLowLevelDataset, dataset_path: str | None,
                 indices: np.ndarray, num_samples: int | None, index_split: Split,
                 config: GPTDatasetConfig) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset: expected a config without blend or "
                             "blend_per_split (config.mock), found one with a blend")
        super().__init__(dataset, dataset_path, indices, num_samples,  # type: ignore[arg-type]
                         index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:  # type: ignore[override]
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str | None,  # type: ignore[override]
                                config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        if config.tokenizer is None:
            raise ValueError("MockGPTDataset: expected config.tokenizer (its vocab_size and eod "
                             "make the mock tokens), found None")
        return MockGPTLowLevelDataset(config.tokenizer)
