"""`build_gpt_datasets`: train/valid/test datasets from a config, as megatron-core's
`BlendedMegatronDatasetBuilder(GPTDataset, sizes, ..., config).build()` builds them.

- `blend` + `split`: every dataset is cut into the three splits by document ranges; a single
  unweighted prefix gives plain `GPTDataset`s, anything else a `BlendedDataset` per split.
- `blend_per_split`: each split has its own blend of whole datasets.
- With weights, each dataset provides `ceil(ceil(size * weight) * (1 + surplus))` samples and
  the blend takes `sum(ceil(size * weight))`; without, each dataset provides one epoch and the
  blend weighs them by length (taking all of them when the split's size is None).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asynctron.datasets._blended import BlendedDataset
from asynctron.datasets._config import GPTDatasetConfig
from asynctron.datasets._gpt import GPTDataset
from asynctron.datasets._indexed import IndexedDataset
from asynctron.datasets._splits import (
    Split,
    SplitMatrix,
    normalize,
    sizes_per_dataset,
    split_bounds,
)

TopLevelDataset = GPTDataset | BlendedDataset


def build_gpt_datasets(config: GPTDatasetConfig, sizes: Sequence[int | None]
                       ) -> list[TopLevelDataset | None]:
    """The train, valid and test datasets (None where a split is empty or has no blend).

    Args:
        config: blend(s), split and sample options.
        sizes: samples wanted per split (train, valid, test); None: one epoch.

    Raises:
        ValueError: no blend, or weights without a size for a split.
        FileNotFoundError, CorruptDatasetError: a dataset's files.
    """
    if len(sizes) != len(Split):
        raise ValueError(f"sizes: expected {len(Split)} (train, valid, test), found {len(sizes)}")
    if config.blend is None and config.blend_per_split is None:
        raise ValueError("config: expected blend or blend_per_split, found neither; mock data "
                         "is not supported")
    blends = [config.blend] * len(Split) if config.blend_per_split is None else list(
        config.blend_per_split)
    for split in Split:
        blend = blends[split.value]
        if blend is not None and blend[1] is not None and sizes[split.value] is None:
            raise ValueError(f"sizes[{split.value}] ({split.name}): expected a number of samples "
                             "with blend weights, found None")
    return _Builder(config, sizes).build()


class _Builder:
    def __init__(self, config: GPTDatasetConfig, sizes: Sequence[int | None]) -> None:
        self.config = config
        self.sizes = list(sizes)
        self._low_level: dict[str, IndexedDataset] = {}

    def build(self) -> list[TopLevelDataset | None]:
        config = self.config
        if config.blend is not None:
            prefixes, weights = config.blend
            return self._blend(list(prefixes), weights, config.split_matrix, self.sizes,
                               list(Split))
        assert config.blend_per_split is not None
        out: list[TopLevelDataset | None] = [None] * len(Split)
        for split in Split:
            blend = config.blend_per_split[split.value]
            if blend is None:
                continue
            only: SplitMatrix = [None] * len(Split)
            only[split.value] = (0.0, 1.0)
            sizes: list[int | None] = [0] * len(Split)
            sizes[split.value] = self.sizes[split.value]
            out[split.value] = self._blend(list(blend[0]), blend[1], only, sizes, [split])[
                split.value]
        return out

    def _blend(self, prefixes: list[str], weights: Sequence[float] | None, matrix: SplitMatrix,
               sizes: list[int | None], splits: list[Split]) -> list[TopLevelDataset | None]:
        normalized = normalize(weights) if weights is not None else None
        if len(prefixes) == 1 and normalized is None:
            return self._splits(prefixes[0], matrix, sizes)
        if normalized is None:
            targets = None
            buffers: list[list[int | None]] = [[None] * len(Split) for _ in prefixes]
        else:
            targets = sizes_per_dataset(normalized, sizes)
            buffers = [list(row) for row in sizes_per_dataset(
                normalized, sizes, surplus=self.config.mid_level_dataset_surplus)]
        per_prefix = [self._splits(prefix, matrix, buffers[d])
                      for d, prefix in enumerate(prefixes)]
        out: list[TopLevelDataset | None] = [None] * len(Split)
        for split in splits:
            i = split.value
            if matrix[i] is None:
                continue
            datasets = [row[i] for row in per_prefix]
            assert all(d is not None for d in datasets)
            if targets is not None:
                blend_weights: list[float] = list(normalized or [])
                size: int | None = sum(row[i] for row in targets)
            else:
                blend_weights = [len(d) for d in datasets if d is not None]
                size = (min(sizes[i], sum(blend_weights)) if sizes[i] is not None
                        else None)
            out[i] = BlendedDataset([d for d in datasets if d is not None], blend_weights,
                                    size, self.config)
        return out

    def _splits(self, prefix: str, matrix: SplitMatrix, sizes: Sequence[int | None]
                ) -> list[GPTDataset | None]:
        """One GPTDataset per split of one IndexedDataset (megatron's
        `_build_megatron_dataset_splits`)."""
        if prefix not in self._low_level:
            self._low_level[prefix] = IndexedDataset(prefix)
        low_level = self._low_level[prefix]
        out: list[GPTDataset | None] = []
        for split in Split:
            bookends = matrix[split.value]
            if bookends is None:
                out.append(None)
                continue
            begin, end = split_bounds(bookends, len(low_level))
            indices = np.arange(begin, end, dtype=np.int32)
            out.append(GPTDataset(low_level, prefix, indices, sizes[split.value], split,
                                  self.config))
        return out
