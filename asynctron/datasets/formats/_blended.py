"""`BlendedDataset`: several datasets served in megatron's greedy proportions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asynctron.datasets.formats._blending import (
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from asynctron.datasets.formats._cache import CacheEntry, describe, load_or_build
from asynctron.datasets.formats._config import GPTDatasetConfig
from asynctron.datasets.formats._gpt import GPTDataset, TokenRuns
from asynctron.datasets.formats._splits import normalize


@dataclass(frozen=True, slots=True)
class BlendedRuns:
    """Located samples of a blend: their dataset ids, and per dataset read, the batch rows
    its samples fill and where their tokens lie."""

    dataset_ids: np.ndarray
    parts: list[tuple[GPTDataset, np.ndarray, TokenRuns]]


_INDEX_LAYOUT = {
    "dataset_index": ((np.int16,), 1, None),
    "dataset_sample_index": ((np.int64,), 1, None),
}


class BlendedDataset(torch.utils.data.Dataset):
    """Sample `i` is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`, plus its
    `dataset_id`; megatron-core's constructor and indices.

    Args:
        datasets: the datasets of one split (`GPTDataset`s for batches from `AsyncLoader`; any
            dataset with megatron's `unique_identifiers` and `index_split` otherwise).
        weights: their weights; with `size`, normalized and blended greedily; without, integer
            sample counts taken exactly (megatron's exhaustive blend).
        size: the number of samples, or None for the exhaustive blend.
        config: the config (its `path_to_cache` holds the indices; None: not cached).

    Raises:
        ValueError: bad weights, or the blend asks a dataset for more samples than it has
            (raise `mid_level_dataset_surplus`).
    """

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float],
                 size: int | None, config: GPTDatasetConfig | Any) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"blend: expected one weight per dataset ({len(datasets)}), found "
                             f"{len(weights)}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights: expected all > 0, found {list(weights)}")
        if len({d.index_split for d in datasets}) != 1:
            raise ValueError("blend: expected datasets of one split, found "
                             f"{sorted({d.index_split.name for d in datasets})}")
        if size is None and any(float(w) != int(w) for w in weights):
            raise ValueError(f"blend weights: expected integer sample counts when size is None, "
                             f"found {list(weights)}")
        self.datasets = list(datasets)
        self.split = datasets[0].index_split
        self.weights = normalize(weights) if size is not None else list(weights)
        self.size = size
        self.config = config
        self.unique_identifiers = {
            "class": type(self).__name__,
            "datasets": [d.unique_identifiers for d in self.datasets],
            "split": self.split.name,
            "weights": self.weights,
            "size": self.size,
        }
        self.unique_description, self.unique_description_hash = describe(
            self.unique_identifiers)
        entry = None
        if config.path_to_cache:
            entry = CacheEntry(config.path_to_cache, self.unique_description_hash,
                               type(self).__name__, self.split.name, self.unique_description)
        arrays = load_or_build(entry, _INDEX_LAYOUT, self._build_indices,
                               must_exist=getattr(config, "fast_cache_load", False))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def _build_indices(self) -> dict[str, np.ndarray]:
        if self.size is not None:
            dataset_index, sample_index = build_blending_indices(self.weights, self.size)
        else:
            dataset_index, sample_index = build_exhaustive_blending_indices(
                [int(w) for w in self.weights])
        used, counts = np.unique(dataset_index, return_counts=True)
        for d, count in zip(used.tolist(), counts.tolist(), strict=True):
            if count > len(self.datasets[d]):
                raise ValueError(
                    f"blend {self.split.name}: expected at most {len(self.datasets[d])} samples "
                    f"from dataset {d} ({self.datasets[d].dataset_path}), found {count} "
                    f"requested; raise mid_level_dataset_surplus (now "
                    f"{self.config.mid_level_dataset_surplus})")
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def batch_fields(self) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]]:
        """`(key, dtype, shape of one sample)` of what `write_samples` writes (see
        `GPTDataset.batch_fields`)."""
        fields = self.datasets[0].batch_fields()
        for dataset in self.datasets[1:]:
            if dataset.batch_fields() != fields:
                raise ValueError(f"blend: expected samples of one shape, found {fields} in "
                                 f"{self.datasets[0].dataset_path} and {dataset.batch_fields()} "
                                 f"in {dataset.dataset_path}")
        return [("dataset_id", self.dataset_index.dtype, ()), *fields]

    @property
    def shared_attention_mask(self) -> torch.Tensor | None:
        """The causal mask every sample shares (see `GPTDataset.shared_attention_mask`)."""
        return self.datasets[0].shared_attention_mask

    def locate_batch(self, ids: Sequence[int]) -> BlendedRuns:
        """Where the tokens of samples `ids` lie (for `token_ranges` and `write_samples`)."""
        rows = np.asarray(ids, np.int64)
        owners = self.dataset_index[rows]
        inner = self.dataset_sample_index[rows]
        parts = []
        for d in np.unique(owners).tolist():
            mine = owners == d
            parts.append((self.datasets[d], np.flatnonzero(mine),
                          self.datasets[d].locate_batch(inner[mine].tolist())))
        return BlendedRuns(owners, parts)

    def token_ranges(self, located: BlendedRuns) -> tuple[np.ndarray, np.ndarray]:
        """`(addresses, nbytes)` of the mapped `.bin` bytes that `located` reads."""
        found = [dataset.token_ranges(runs) for dataset, _, runs in located.parts]
        return (np.concatenate([addresses for addresses, _ in found]),
                np.concatenate([nbytes for _, nbytes in found]))

    def fetch_ahead(self, located: BlendedRuns) -> None:
        """Start fetching what `located` reads from datasets on object storage."""
        for dataset, _, runs in located.parts:
            dataset.fetch_ahead(runs)

    def write_samples(self, located: BlendedRuns, out: dict[str, np.ndarray]) -> None:
        """Write the located samples into `out` (arrays keyed as `batch_fields`, first
        dimension the batch): the same values as `ds[i]` for each, stacked."""
        out["dataset_id"][:] = located.dataset_ids
        for dataset, rows, runs in located.parts:
            dataset.write_samples(runs, out, rows)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        dataset_id = self.dataset_index[idx]
        return {"dataset_id": dataset_id,
                **self.datasets[dataset_id][int(self.dataset_sample_index[idx])]}

    def __repr__(self) -> str:
        return (f"<BlendedDataset {self.split.name}: {len(self)} samples from "
                f"{len(self.datasets)} datasets>")

