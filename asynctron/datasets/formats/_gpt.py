"""`GPTDataset`: fixed-length samples cut across documents, as megatron-core's GPTDataset.

Three indices, identical to megatron-core's for the same inputs (see `_sample_index`):
the document index (shuffled document ids, one copy per epoch), the sample index (where each
sample starts) and the shuffle index (the order samples are served in). They are cached as
`.npy` files (see `_cache`) and mapped. `ds[i]` returns megatron's sample dict, bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asynctron.datasets.formats._cache import CacheEntry, describe, load_or_build
from asynctron.datasets.formats._config import GPTDatasetConfig
from asynctron.datasets.formats._indexed import IndexedDataset
from asynctron.datasets.formats._sample_index import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    num_samples_of,
)
from asynctron.datasets.formats._splits import Split
from asynctron.datasets.object_cache._object_storage import (
    ObjectStorageConfig,
    cache_path,
    is_object_storage_path,
)

#: Final-epoch rule: a last epoch contributing fewer than this share of an epoch's samples is
#: shuffled on its own (megatron-core's `threshold = 0.80`).
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass(frozen=True, slots=True)
class TokenRuns:
    """The token runs of located samples: run `i` is `counts[i]` tokens from token
    `starts[i]` of the `.bin`, going to element `destinations[i]` of a `(num_samples,
    width)` array."""

    starts: np.ndarray
    counts: np.ndarray
    destinations: np.ndarray
    num_samples: int


_INDEX_LAYOUT = {
    "document_index": ((np.int32,), 1, None),
    "sample_index": ((np.int32, np.int64), 2, 2),
    "shuffle_index": ((np.uint32, np.int64), 1, None),
}


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `config.sequence_length` tokens from the documents `indexed_indices` of an
    `IndexedDataset`; megatron-core's constructor arguments and sample dicts.

    Args:
        indexed_dataset: the tokens.
        dataset_path: its path prefix, for the cache key (None: `indexed_dataset.path_prefix`).
        indexed_indices: the document ids this split may use (int32).
        num_samples: the samples to provide (more epochs are added as needed); None: one epoch.
        index_split: which split this is (valid keeps a partial last sample when
            `drop_last_partial_validation_sequence` is False).
        config: the config.

    Memory: the three indices are `.npy` maps (12-20 bytes per sample, paged in on use).
    Concurrency: `ds[i]` is thread-safe; pickling reopens the files.
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str | None,
                 indexed_indices: np.ndarray, num_samples: int | None, index_split: Split,
                 config: GPTDatasetConfig) -> None:
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path if dataset_path is not None else getattr(
            indexed_dataset, "path_prefix", None)
        self.indices = np.asarray(indexed_indices, np.int32)
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.pad_id = config.resolve_pad_id()
        self.drop_last_partial_sequence = (index_split != Split.valid
                                           or config.drop_last_partial_validation_sequence)
        self.num_tokens_per_epoch = int(np.sum(indexed_dataset.sequence_lengths[self.indices],
                                               dtype=np.int64))
        self.unique_identifiers = self._identity()
        self.unique_description, self.unique_description_hash = describe(
            self.unique_identifiers)
        self._arrays: dict[str, np.ndarray] | None = None
        if not config.defer_npy_index_mmap:
            self._load_indices()
        self._prepare_reads()

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """The `IndexedDataset` at `dataset_path` (megatron's `build_low_level_dataset`)."""
        if is_object_storage_path(dataset_path):
            if config.object_storage_cache_path is None:
                raise ValueError(f"dataset {dataset_path}: expected "
                                 "GPTDatasetConfig.object_storage_cache_path (a local "
                                 "directory) for a dataset on object storage, found None")
            budget = config.object_storage_cache_bytes
            storage = ObjectStorageConfig(config.object_storage_cache_path, **(
                {} if budget is None else {"cache_budget_bytes": budget}))
            return IndexedDataset(dataset_path, multimodal=False, mmap=False,
                                  object_storage_config=storage)
        sequences_per_dataset = dtype_code = None
        if config.sequences_per_dataset:  # the tokenizer's dtype is expected with them only
            sequences_per_dataset = tuple(config.sequences_per_dataset[dataset_path])
            dtype_code = config.token_dtype_code
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files,
                              fast_cache_load=config.fast_cache_load,
                              sequences_per_dataset=sequences_per_dataset,
                              dtype_code=dtype_code)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """Documents the splits are cut from (megatron's `numel_low_level_dataset`)."""
        return int(low_level_dataset.document_indices.shape[0] - 1)

    def _load_indices(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = load_or_build(self._cache_entry(), _INDEX_LAYOUT, self._build_indices,
                                         must_exist=self.config.fast_cache_load
                                         or self.config.defer_npy_index_mmap)
        return self._arrays

    @property
    def document_index(self) -> np.ndarray:
        """The split's document ids, once per epoch, shuffled (int32)."""
        return self._load_indices()["document_index"]

    @property
    def sample_index(self) -> np.ndarray:
        """Row `i`: (position in the document index, token offset) where sample `i` starts."""
        return self._load_indices()["sample_index"]

    @property
    def shuffle_index(self) -> np.ndarray:
        """The order samples are served in."""
        return self._load_indices()["shuffle_index"]

    def _identity(self) -> dict[str, Any]:
        """Every input that changes the indices (megatron's key omits
        `add_extra_token_to_sequence`, the drop-last rule and the data itself)."""
        indices = self.indices
        contiguous = indices.size > 0 and np.array_equal(
            indices, np.arange(indices[0], indices[0] + indices.size, dtype=np.int32))
        documents: Any = ([int(indices[0]), int(indices[0]) + indices.size] if contiguous
                          else describe({"indices": indices.tolist()})[1])
        data = self.dataset
        return {
            "class": type(self).__name__,
            "dataset_path": self.dataset_path,
            "dataset": {"num_sequences": len(data), "num_documents": data.num_documents,
                        "dtype": data.dtype.name},
            "documents": documents,
            "num_tokens_per_epoch": self.num_tokens_per_epoch,
            "num_samples": self.num_samples,
            "index_split": self.index_split.name,
            "random_seed": self.config.random_seed,
            "sequence_length": self.config.sequence_length,
            "add_extra_token_to_sequence": self.config.add_extra_token_to_sequence,
            "drop_last_partial_sequence": self.drop_last_partial_sequence,
        }

    def _cache_entry(self) -> CacheEntry | None:
        directory = self.config.path_to_cache
        if directory is None:
            prefix = getattr(self.dataset, "path_prefix", None)
            if prefix is None:  # mock data: nothing on disk to cache beside
                return None
            if is_object_storage_path(prefix):  # beside the dataset's cached files
                prefix = cache_path(prefix, self.config.object_storage_cache_path)
            directory = os.path.join(prefix, "cache", f"{type(self).__name__}_indices")
        return CacheEntry(directory, self.unique_description_hash, type(self).__name__,
                          self.index_split.name, self.unique_description)

    def num_epochs(self) -> int:
        """Epochs needed for `num_samples` (megatron-core's `_get_num_epochs`)."""
        if self.num_samples is None:
            return 1
        needed = self.num_samples * self.config.sequence_length + int(
            self.config.add_extra_token_to_sequence)
        return max(1, -(-needed // self.num_tokens_per_epoch))

    def _build_indices(self) -> dict[str, np.ndarray]:
        config = self.config
        if self.num_tokens_per_epoch < 2:
            raise ValueError(f"dataset {self.dataset_path} split {self.index_split.name}: "
                             f"expected at least 2 tokens, found {self.num_tokens_per_epoch}; "
                             "give the split more documents")
        length = config.sequence_length
        extra = int(config.add_extra_token_to_sequence)
        num_epochs = self.num_epochs()
        separate_final_epoch = False
        num_samples_sans_final_epoch = 0
        if num_epochs > 1:
            assert self.num_samples is not None
            num_samples_sans_final_epoch = (
                (num_epochs - 1) * self.num_tokens_per_epoch - extra) // length
            from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            per_epoch = (self.num_tokens_per_epoch - extra) // length
            assert 0 <= from_final_epoch <= per_epoch + 1, (from_final_epoch, per_epoch)
            separate_final_epoch = from_final_epoch < int(
                SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        random_state = np.random.RandomState(config.random_seed)
        document_index = build_document_index(self.indices, num_epochs, random_state,
                                              separate_final_epoch)
        sample_index = build_sample_index(
            self.dataset.sequence_lengths, document_index, length, num_epochs,
            self.num_tokens_per_epoch, self.drop_last_partial_sequence,
            config.add_extra_token_to_sequence)
        num_samples = sample_index.shape[0] - 1
        shuffle_index = build_shuffle_index(
            num_samples_sans_final_epoch if separate_final_epoch else num_samples, num_samples,
            random_state)
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index}

    def _prepare_reads(self) -> None:
        config = self.config
        self._extra = int(config.add_extra_token_to_sequence)
        self._width = config.sequence_length + self._extra
        self._tokens = getattr(self.dataset, "tokens", None)
        self._pointers = self.dataset.sequence_pointers
        self._itemsize = self.dataset.dtype.itemsize
        self._cacheable = not (config.reset_position_ids or config.reset_attention_mask
                               or config.eod_mask_loss)
        length = config.sequence_length
        self._loss_mask = torch.ones(length, dtype=torch.float)
        self._position_ids = torch.arange(length, dtype=torch.long)
        self._attention_mask = (torch.ones(length, length, dtype=torch.bool).triu(1)
                                .unsqueeze(0) if config.create_attention_mask else None)

    def __getstate__(self) -> dict[str, Any]:
        return {"args": (self.dataset, self.dataset_path, self.indices, self.num_samples,
                         self.index_split, self.config)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(*state["args"])  # type: ignore[misc]

    def __len__(self) -> int:
        if self._arrays is None:  # deferred: counted without mapping the indices, as megatron
            return num_samples_of(self.num_epochs() * self.num_tokens_per_epoch,
                                  self.config.sequence_length, self.drop_last_partial_sequence,
                                  self.config.add_extra_token_to_sequence)
        return self.sample_index.shape[0] - 1

    def sample_parts(self, idx: int) -> list[tuple[int, int, int]]:
        """`(document, token offset, token count)` of each part sample `idx` reads, in order."""
        shuffled = int(self.shuffle_index[idx])
        beg, beg_offset = self.sample_index[shuffled].tolist()
        end, end_offset = self.sample_index[shuffled + 1].tolist()
        document_index = self.document_index
        if beg == end:
            return [(int(document_index[beg]), beg_offset,
                     end_offset - beg_offset + self._extra)]
        lengths = self.dataset.sequence_lengths
        parts = []
        for i in range(beg, end + 1):
            document = int(document_index[i])
            offset = beg_offset if i == beg else 0
            count = (end_offset + self._extra if i == end
                     else int(lengths[document]) - offset)
            parts.append((document, offset, count))
        return parts

    def sample_text(self, parts: list[tuple[int, int, int]]) -> np.ndarray:
        """The tokens of `parts` as int64 (`sequence_length` plus the extra token), padded."""
        return self._texts(self._runs([parts]))[0]

    def _runs(self, parts_of_samples: Sequence[list[tuple[int, int, int]]]) -> TokenRuns:
        runs: list[tuple[int, int, int]] = []
        pointers, itemsize, width = self._pointers, self._itemsize, self._width
        for row, parts in enumerate(parts_of_samples):
            position = row * width
            for document, offset, count in parts:
                runs.append((int(pointers[document]) // itemsize + offset, count, position))
                position += count
        table = np.array(runs, np.int64).reshape(-1, 3).T.copy()
        return TokenRuns(table[0], table[1], table[2], len(parts_of_samples))

    def _texts(self, runs: TokenRuns) -> np.ndarray:
        """The tokens of each sample of `runs`, a row each, as `sample_text`."""
        text = np.full((runs.num_samples, self._width), self.pad_id, np.int64)
        self.dataset.gather(runs.starts, runs.counts, text, runs.destinations)
        return text

    def locate_batch(self, ids: Sequence[int]) -> TokenRuns:
        """Where the tokens of samples `ids` lie (for `token_ranges` and `write_samples`)."""
        return self._runs([self.sample_parts(int(i)) for i in ids])

    def token_ranges(self, runs: TokenRuns) -> tuple[np.ndarray, np.ndarray]:
        """`(addresses, nbytes)` of the mapped `.bin` bytes that `runs` read; none when the
        tokens are not mapped (`mmap=False`, mock data)."""
        if self._tokens is None:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return (self._tokens.ctypes.data + runs.starts * self._itemsize,
                runs.counts * self._itemsize)

    def fetch_ahead(self, runs: TokenRuns) -> None:
        """Start fetching what `runs` read into the local cache of a dataset on object
        storage; returns at once (a no-op for local files)."""
        fetch = getattr(self.dataset, "fetch_ahead", None)
        if fetch is not None:
            fetch(runs.starts, runs.counts)

    def batch_fields(self) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]]:
        """`(key, dtype, shape of one sample)` of what `write_samples` writes, in the order of
        the sample dict; a cached causal mask, the same for every sample, is not among them."""
        length = self.config.sequence_length
        fields: list[tuple[str, np.dtype[Any], tuple[int, ...]]] = [
            ("tokens", np.dtype(np.int64), (length,)),
            ("labels", np.dtype(np.int64), (length,))]
        if self.config.create_attention_mask and not self._cacheable:
            fields.append(("attention_mask", np.dtype(np.bool_), (1, length, length)))
        fields += [("loss_mask", np.dtype(np.float32), (length,)),
                   ("position_ids", np.dtype(np.int64), (length,))]
        return fields

    @property
    def shared_attention_mask(self) -> torch.Tensor | None:
        """The causal mask every sample shares, `(1, L, L)`, or None when there is none or
        each sample has its own."""
        return self._attention_mask if self._cacheable else None

    def write_samples(self, runs: TokenRuns, out: dict[str, np.ndarray],
                      rows: slice | np.ndarray = slice(None)) -> None:
        """Write the located samples into rows `rows` of `out` (arrays keyed as
        `batch_fields`, first dimension the batch): the same values as `ds[i]` for each,
        stacked."""
        text = self._texts(runs)
        if not self._cacheable:  # per-sample masks: megatron's rules, sample by sample
            samples = [self._sample_dict(row, padding=False) for row in text]
            for key, _, _ in self.batch_fields():
                out[key][rows] = np.stack([sample[key].numpy() for sample in samples])
            return
        pad, length = self.pad_id, self.config.sequence_length
        if self._extra and not (text == pad).any():  # the common case: nothing to mask
            out["tokens"][rows] = text[:, :length]
            out["labels"][rows] = text[:, 1:]
            out["loss_mask"][rows] = 1.0
            out["position_ids"][rows] = self._position_ids.numpy()
            return
        if self._extra:
            labels = text[:, 1:]
        else:
            labels = np.empty_like(text)
            labels[:, :-1] = text[:, 1:]
            labels[:, -1] = pad
        label_pads = labels == pad
        out["loss_mask"][rows] = ~label_pads
        out["labels"][rows] = np.where(label_pads, 0, labels)
        tokens = text[:, :length]
        out["tokens"][rows] = np.where(tokens == pad, 0, tokens)
        out["position_ids"][rows] = self._position_ids.numpy()

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        """Megatron's sample dict: tokens, labels, attention_mask (if created), loss_mask,
        position_ids. `idx=None` is a padding sample (sample 0 with a zero loss mask)."""
        parts = self.sample_parts(0 if idx is None else int(idx))
        return self._sample_dict(self.sample_text(parts), padding=idx is None)

    def _sample_dict(self, text: np.ndarray, padding: bool) -> dict[str, torch.Tensor]:
        pad = self.pad_id
        if self._extra:
            tokens_np, labels_np = text[:-1], text[1:]
        else:
            tokens_np = text
            labels_np = np.empty_like(text)
            labels_np[:-1] = text[1:]
            labels_np[-1] = pad
        if self._cacheable:
            loss_mask = self._loss_mask.clone()
            attention_mask, position_ids = self._attention_mask, self._position_ids
        else:
            attention_mask, loss_mask, position_ids = self._masks(tokens_np)
        label_pads = labels_np == pad
        if label_pads.any():
            loss_mask[torch.from_numpy(label_pads)] = 0.0
            labels_np[label_pads] = 0
        np.putmask(text, text == pad, 0)
        if padding:
            loss_mask = torch.zeros_like(loss_mask)
        sample = {"tokens": torch.from_numpy(tokens_np), "labels": torch.from_numpy(labels_np)}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _masks(self, tokens: np.ndarray) -> tuple[torch.Tensor | None, torch.Tensor,
                                                  torch.Tensor]:
        """Megatron's `_get_ltor_masks_and_position_ids` for the resetting options, vectorised."""
        config = self.config
        length = tokens.size
        is_eod = tokens == config.eod
        loss_mask = np.ones(length, np.float32)
        if config.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        positions = np.arange(length, dtype=np.int64)
        eods = np.flatnonzero(is_eod)
        if config.reset_position_ids and eods.size:
            restart = np.zeros(length, np.int64)
            after = eods + 1
            after = after[after < length]
            restart[after] = after
            positions -= np.maximum.accumulate(restart)
        attention_mask = None
        if config.create_attention_mask:
            masked = np.triu(np.ones((length, length), bool), 1)
            if config.reset_attention_mask and eods.size:
                segment = np.zeros(length, np.int64)  # end-of-documents before each position
                segment[1:] = np.cumsum(is_eod[:-1])
                masked |= segment[:, None] != segment[None, :]
            attention_mask = torch.from_numpy(masked).unsqueeze(0)
        return attention_mask, torch.from_numpy(loss_mask), torch.from_numpy(positions)

    def __repr__(self) -> str:
        return (f"<GPTDataset {self.dataset_path!r} {self.index_split.name}: {len(self)} samples "
                f"of {self.config.sequence_length} tokens>")
