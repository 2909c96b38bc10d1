"""`BlendedMegatronDatasetBuilder`: train/valid/test datasets of any megatron dataset class
from a config, as megatron-core's builder of the same name builds them.

- mock data (no blend): the class's low-level dataset from `build_low_level_dataset(None,
  config)`, cut by `split` ("1,1,1" unless given).
- `blend` + `split`: every dataset is cut into the three splits by document ranges; a single
  unweighted prefix gives plain datasets, anything else a `BlendedDataset` per split.
- `blend_per_split`: each split has its own blend of whole datasets; a single prefix gives a
  plain dataset of exactly the split's size, weighted or not.
- With weights, each dataset provides `ceil(ceil(size * weight) * (1 + surplus))` samples and
  the blend takes `sum(ceil(size * weight))`; without, each dataset provides one epoch and the
  blend weighs them by length (taking all of them when the split's size is None).

A dataset class needs megatron's `MegatronDataset` interface: the constructor
`(low_level_dataset, dataset_path, indices, num_samples, index_split, config)` and the static
`build_low_level_dataset(dataset_path, config)` and `numel_low_level_dataset(low_level_dataset)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch.distributed as dist

from asynctron.datasets.formats._blended import BlendedDataset
from asynctron.datasets.formats._config import GPTDatasetConfig
from asynctron.datasets.formats._gpt import GPTDataset
from asynctron.datasets.formats._mock import MockGPTDataset
from asynctron.datasets.formats._splits import (
    Split,
    SplitMatrix,
    normalize,
    sizes_per_dataset,
    split_bounds,
)
from asynctron.errors import BlendSizeError, PeerError


class BlendedMegatronDatasetBuilder:
    """Builds the train, valid and test datasets of `cls` (None where a split is empty, has no
    blend, or `is_built_on_rank()` is False under torch.distributed).

    Args:
        cls: the dataset class (`GPTDataset`, `MockGPTDataset`, or any class with megatron's
            `MegatronDataset` interface).
        sizes: samples wanted per split (train, valid, test); None: one epoch.
        is_built_on_rank: whether this rank builds datasets at all.
        config: blend(s), split and sample options (asynctron's `GPTDatasetConfig`, or a
            megatron-core config with the same fields).

    Under torch.distributed, rank 0 builds first (writing every index cache) while the other
    ranks wait, then they build, loading the caches; with `config.fast_cache_load` every rank
    loads at once.

    Raises (from `build`):
        BlendSizeError: weights without a size for a split.
        FileNotFoundError, CorruptDatasetError: a dataset's files.
        PeerError: rank 0 failed to build (on the other ranks).
    """

    def __init__(self, cls: type, sizes: Sequence[int | None], is_built_on_rank: Callable[[], bool],
                 config: Any) -> None:
        if len(sizes) != len(Split):
            raise ValueError(f"sizes: expected {len(Split)} (train, valid, test), found "
                             f"{len(sizes)}")
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        self._low_level: dict[str | None, Any] = {}
        if not config.mock:
            for split in Split:
                blend = (config.blend if config.blend_per_split is None
                         else config.blend_per_split[split.value])
                if blend is not None and blend[1] is not None and sizes[split.value] is None:
                    raise BlendSizeError(
                        f"sizes[{split.value}] ({split.name}): expected a number of samples "
                        "with blend weights, found None")

    def build(self) -> list[Any | None]:
        """The three datasets (see the class). Call it on every rank."""
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed or dist.get_world_size() == 1 or getattr(
                self.config, "fast_cache_load", False):
            return self._build_here()
        failure: list[str | None] = [None]
        datasets: list[Any | None] = [None] * len(Split)
        if dist.get_rank() == 0:
            try:
                datasets = self._build_here()
            except BaseException as exc:  # the others wait in the broadcast below
                failure[0] = f"{type(exc).__name__}: {exc}"
                dist.broadcast_object_list(failure, src=0)
                raise
        dist.broadcast_object_list(failure, src=0)
        if dist.get_rank() != 0:
            if failure[0] is not None:
                raise PeerError(f"building datasets: rank 0 failed ({failure[0]}); see its "
                                "error", rank=0)
            datasets = self._build_here()
        return datasets

    def _build_here(self) -> list[Any | None]:
        if dist.is_available() and dist.is_initialized() and not self.is_built_on_rank():
            return [None] * len(Split)
        config = self.config
        if config.mock:
            return self._splits(None, config.split_matrix, self.sizes)
        if config.blend is not None:
            prefixes, weights = config.blend
            if len(prefixes) == 1 and weights is None:
                return self._splits(prefixes[0], config.split_matrix, self.sizes)
            return self._blend(list(prefixes), weights, config.split_matrix, self.sizes,
                               list(Split))
        out: list[Any | None] = [None] * len(Split)
        for split in Split:
            blend = config.blend_per_split[split.value]
            if blend is None:
                continue
            only: SplitMatrix = [None] * len(Split)
            only[split.value] = (0.0, 1.0)
            sizes: list[int | None] = [0] * len(Split)
            sizes[split.value] = self.sizes[split.value]
            prefixes, weights = blend
            if len(prefixes) == 1:
                out[split.value] = self._splits(prefixes[0], only, sizes)[split.value]
            else:
                out[split.value] = self._blend(list(prefixes), weights, only, sizes,
                                               [split])[split.value]
        return out

    def _blend(self, prefixes: list[str], weights: Sequence[float] | None, matrix: SplitMatrix,
               sizes: list[int | None], splits: list[Split]) -> list[BlendedDataset | None]:
        normalized = normalize(weights) if weights is not None else None
        if normalized is None:
            targets = None
            buffers: list[list[int | None]] = [[None] * len(Split) for _ in prefixes]
        else:
            targets = sizes_per_dataset(normalized, sizes)
            buffers = [list(row) for row in sizes_per_dataset(
                normalized, sizes, surplus=self.config.mid_level_dataset_surplus)]
        threads = getattr(self.config, "num_dataset_builder_threads", 1)
        with ThreadPoolExecutor(max_workers=threads) as pool:
            per_prefix = list(pool.map(lambda d: self._splits(prefixes[d], matrix, buffers[d]),
                                       range(len(prefixes))))
        out: list[BlendedDataset | None] = [None] * len(Split)
        for split in splits:
            i = split.value
            if matrix[i] is None:
                continue
            datasets = [row[i] for row in per_prefix]
            if targets is not None:
                blend_weights: list[float] = list(normalized or [])
                size: int | None = sum(row[i] for row in targets)
            else:
                blend_weights = [len(d) for d in datasets]
                size = min(sizes[i], sum(blend_weights)) if sizes[i] is not None else None
            out[i] = BlendedDataset(datasets, blend_weights, size, self.config)
        return out

    def _splits(self, prefix: str | None, matrix: SplitMatrix, sizes: Sequence[int | None]
                ) -> list[Any | None]:
        """One dataset per split of one low-level dataset (megatron's
        `_build_megatron_dataset_splits`)."""
        if prefix not in self._low_level:
            self._low_level[prefix] = self.cls.build_low_level_dataset(prefix, self.config)
        low_level = self._low_level[prefix]
        num_elements = self.cls.numel_low_level_dataset(low_level)
        out: list[Any | None] = []
        for split in Split:
            bookends = matrix[split.value]
            if bookends is None:
                out.append(None)
                continue
            begin, end = split_bounds(bookends, num_elements)
            indices = np.arange(begin, end, dtype=np.int32)
            out.append(self.cls(low_level, prefix, indices, sizes[split.value], split,
                                self.config))
        return out


def build_gpt_datasets(config: GPTDatasetConfig, sizes: Sequence[int | None]
                       ) -> list[GPTDataset | BlendedDataset | None]:
    """`BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()`: the
    train, valid and test GPT datasets (mock ones without a blend)."""
    cls = MockGPTDataset if config.mock else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
