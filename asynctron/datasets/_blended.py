"""`BlendedDataset`: several GPT datasets served in megatron's greedy proportions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from asynctron.datasets._blending import (
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from asynctron.datasets._cache import CacheEntry, describe, load_or_build
from asynctron.datasets._config import GPTDatasetConfig
from asynctron.datasets._gpt import GPTDataset
from asynctron.datasets._splits import normalize

_INDEX_LAYOUT = {
    "dataset_index": ((np.int16,), 1, None),
    "dataset_sample_index": ((np.int64,), 1, None),
}


class BlendedDataset(torch.utils.data.Dataset):
    """Sample `i` is sample `dataset_sample_index[i]` of dataset `dataset_index[i]`, plus its
    `dataset_id`; megatron-core's constructor and indices.

    Args:
        datasets: the GPT datasets of one split.
        weights: their weights; with `size`, normalized and blended greedily; without, integer
            sample counts taken exactly (megatron's exhaustive blend).
        size: the number of samples, or None for the exhaustive blend.
        config: the config (its `path_to_cache` holds the indices; None: not cached).

    Raises:
        ValueError: bad weights, or the blend asks a dataset for more samples than it has
            (raise `mid_level_dataset_surplus`).
    """

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float],
                 size: int | None, config: GPTDatasetConfig) -> None:
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
        self.identity = {
            "class": type(self).__name__,
            "datasets": [d.identity for d in self.datasets],
            "split": self.split.name,
            "weights": self.weights,
            "size": self.size,
        }
        self.description, self.description_hash = describe(self.identity)
        entry = None
        if config.path_to_cache:
            entry = CacheEntry(config.path_to_cache,
                               f"{self.description_hash}-{type(self).__name__}-{self.split.name}",
                               self.description)
        arrays = load_or_build(entry, _INDEX_LAYOUT, self._build_indices)
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

    def locate(self, idx: int) -> tuple[GPTDataset, int]:
        """The dataset and the index in it of blended sample `idx`."""
        return (self.datasets[int(self.dataset_index[idx])],
                int(self.dataset_sample_index[idx]))

    def __getitem__(self, idx: int) -> dict[str, Any]:
        dataset_id = self.dataset_index[idx]
        return {"dataset_id": dataset_id,
                **self.datasets[dataset_id][int(self.dataset_sample_index[idx])]}

    def __repr__(self) -> str:
        return (f"<BlendedDataset {self.split.name}: {len(self)} samples from "
                f"{len(self.datasets)} datasets>")

