"""`GPTDatasetConfig`: what a GPT dataset is built from, with megatron-core's field names."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import FrozenInstanceError, dataclass
from typing import Protocol

import numpy as np

from asynctron.datasets.formats._splits import Split, SplitMatrix, parse_split, split_matrix

#: megatron-core's pad id when the tokenizer has none (or an ambiguous one).
DEFAULT_PAD_ID = -1

#: megatron-core's split of mock data (it replaces the config's).
MOCK_SPLIT = "1,1,1"

Blend = tuple[Sequence[str], Sequence[float] | None]


class Tokenizer(Protocol):
    """What the datasets need of a tokenizer: megatron's `eod` (and optionally `pad`)."""

    @property
    def eod(self) -> int: ...


# Neither frozen (megatron's plain-dataclass subclasses could not extend it) nor slotted (the
# write-once `__setattr__` reads `__dict__`); hashable as when frozen: fields are set once.
@dataclass(kw_only=True, unsafe_hash=True)
class GPTDatasetConfig:
    """How to build GPT datasets; fields named as megatron-core's `GPTDatasetConfig`.

    Without `blend` and `blend_per_split` the config is `mock` (megatron's mock data, split
    "1,1,1" whatever `split` says, as megatron's). Not supported (megatron-only):
    `multiple_validation_sets`, `full_validation`, context/sequence parallel padding.

    Read-only once built: each field is assigned once, by the constructor (or a subclass's
    `__post_init__`, for a field still unset); assigning it again, or any other name, raises
    `dataclasses.FrozenInstanceError`. The datasets read the config when built (indices, cache
    keys) and on every sample, so a later change would part the samples from their indices.
    It is not a frozen dataclass so that megatron's plain `@dataclass` subclasses
    (`GPTFIMDatasetConfig`, `MultimodalDatasetConfig`) can extend it (a `frozen=True` subclass
    cannot); their instances are read-only too.
    """

    random_seed: int
    """Seed of every shuffle (document and sample order)."""
    sequence_length: int
    """Tokens per sample (one more is read when `add_extra_token_to_sequence`)."""
    blend: Blend | None = None
    """`(prefixes, weights or None)` for all splits, cut by `split`."""
    blend_per_split: Sequence[Blend | None] | None = None
    """One blend per split (train, valid, test); exclusive with `blend` and `split`."""
    split: str | None = None
    """Document split for `blend`, e.g. "969,30,1"."""
    path_to_cache: str | None = None
    """Where the `.npy` indices are cached; None: `<prefix>/cache/GPTDataset_indices`, as
    megatron-core does."""
    tokenizer: Tokenizer | None = None
    """An object with megatron's `eod` (and optionally `pad`, `special_tokens_dict`)."""
    eod_id: int | None = None
    """End-of-document id, instead of `tokenizer.eod`."""
    pad_id: int | None = None
    """Pad id, instead of `tokenizer.pad` (default: -1, megatron's)."""
    reset_position_ids: bool = False
    """Restart position ids after every end-of-document token."""
    reset_attention_mask: bool = False
    """Stop attention across end-of-document tokens."""
    eod_mask_loss: bool = False
    """Zero the loss on end-of-document tokens."""
    create_attention_mask: bool = True
    """Return the (1, L, L) boolean causal mask (True = masked)."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the last, partial sample of the validation split."""
    add_extra_token_to_sequence: bool = True
    """Read `sequence_length + 1` tokens per sample, so tokens and labels are both full."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples built per blended dataset, so the blend never runs short."""
    allow_ambiguous_pad_tokens: bool = False
    """Keep a pad id that equals another special token (megatron's flag)."""
    mmap_bin_files: bool = True
    """Map the `.bin` files; False reads samples with `pread` (see `IndexedDataset`)."""
    fast_cache_load: bool = False
    """Every index is already cached (e.g. by `asynctron prepare-cache`): load it without a
    build, a rank-0-first barrier, or a check for a missing entry (a missing one is an error
    naming it). Needs `path_to_cache`, and `blend_per_split` rather than `blend`."""
    defer_npy_index_mmap: bool = False
    """Map each dataset's cached indices on first use, not at construction (start-up with
    thousands of prefixes); the indices must be cached. Needs `path_to_cache`."""
    sequences_per_dataset: Mapping[str, Sequence[int]] | None = None
    """prefix -> (sequences, document indices) of its `.idx` (megatron's
    `--per-dataset-sequences-path`); checked against each header, with the tokenizer's dtype."""
    num_dataset_builder_threads: int = 1
    """Threads building the datasets of a blend (megatron's field)."""
    object_storage_cache_path: str | None = None
    """The local directory that caches object-storage datasets (`s3://` paths in the blend):
    their `.idx`, the `.bin` ranges read, and the GPT index files when `path_to_cache` is
    None."""
    object_storage_cache_bytes: int | None = None
    """The `.bin` bytes that directory keeps, least recently used evicted beyond it (asynctron's
    field; None: `ObjectStorageConfig`'s default, 16 GiB)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name not in self.__dataclass_fields__:
            raise FrozenInstanceError(f"cannot assign to {name!r}: not a field of "
                                      f"{type(self).__name__}; declare it (`field(init=False)` "
                                      "for a value __post_init__ derives)")
        if name in self.__dict__:
            raise FrozenInstanceError(f"cannot assign to field {name!r}: the config is "
                                      "read-only once built (dataclasses.replace makes a new one)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}: the config is read-only")

    def __post_init__(self) -> None:
        for name in ("random_seed", "sequence_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name}: expected an int, found {value!r}")
        if self.sequence_length < 2:
            raise ValueError(f"sequence_length: expected >= 2, found {self.sequence_length}")
        for name in ("fast_cache_load", "defer_npy_index_mmap"):
            if getattr(self, name) and self.path_to_cache is None:
                raise ValueError(f"{name}: expected path_to_cache (where the indices are "
                                 "cached) beside it, found None")
        if self.fast_cache_load and self.blend is not None:
            raise ValueError("fast_cache_load: expected blend_per_split, found blend; with blend "
                             "every split's datasets are cut from the same files, give each "
                             "split its own blend")
        if self.sequences_per_dataset is not None and self.token_dtype_code is None:
            raise ValueError("sequences_per_dataset: expected a tokenizer with vocab_size (the "
                             "token dtype is checked against it), found none")
        if self.num_dataset_builder_threads < 1:
            raise ValueError(f"num_dataset_builder_threads: expected >= 1, found "
                             f"{self.num_dataset_builder_threads}")
        if self.mid_level_dataset_surplus < 0:
            raise ValueError(f"mid_level_dataset_surplus: expected >= 0, found "
                             f"{self.mid_level_dataset_surplus!r}")
        if self.blend_per_split is not None:
            if self.blend is not None or self.split is not None:
                raise ValueError("blend_per_split: expected neither blend nor split beside it, "
                                 "found one; use blend + split or blend_per_split")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(f"blend_per_split: expected {len(Split)} blends (train, valid, "
                                 f"test; None to skip one), found {len(self.blend_per_split)}")
            for blend in self.blend_per_split:
                if blend is not None:
                    _check_blend("blend_per_split", blend)
        elif self.blend is not None:
            _check_blend("blend", self.blend)
            if self.split is None:
                raise ValueError("split: expected a split string such as '969,30,1' with "
                                 "blend, found None")
            parse_split(self.split)
        if (self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss) and (
                self.eod is None):
            raise ValueError("eod_id: expected an end-of-document id (or a tokenizer with "
                             "`eod`) for reset_position_ids/reset_attention_mask/eod_mask_loss, "
                             "found none")

    @property
    def mock(self) -> bool:
        """No blend and no blend_per_split: megatron's mock data."""
        return self.blend is None and self.blend_per_split is None

    @property
    def split_matrix(self) -> SplitMatrix:
        """The split book-ends (megatron's `split_matrix`); all of [0, 1] per blend_per_split,
        and for mock data always "1,1,1" (as megatron, whatever `split` says)."""
        if self.mock:
            return split_matrix(parse_split(MOCK_SPLIT))
        if self.split is None:
            return [(0.0, 1.0)] * len(Split)
        return split_matrix(parse_split(self.split))

    @property
    def token_dtype_code(self) -> int | None:
        """The token dtype code the tokenizer's vocabulary implies (megatron's rule: 4, int32,
        above 65536 tokens, else 8, uint16); None without a `vocab_size`."""
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        if vocab_size is None:
            return None
        return 4 if vocab_size > np.iinfo(np.uint16).max + 1 else 8

    @property
    def eod(self) -> int | None:
        if self.eod_id is not None:
            return self.eod_id
        return getattr(self.tokenizer, "eod", None)

    def resolve_pad_id(self) -> int:
        """The pad id samples use: megatron-core's rule (`MegatronDataset.__init__`): the
        tokenizer's `pad`, else -1; a pad equal to another special token becomes -1 (with a
        warning) unless `allow_ambiguous_pad_tokens`."""
        if self.pad_id is not None:
            pad = self.pad_id
        else:
            try:
                pad = self.tokenizer.pad
            except Exception:  # megatron treats any failure as "no pad"
                pad = DEFAULT_PAD_ID
        special: list[int] = []
        try:
            special = [v for k, v in self.tokenizer.special_tokens_dict.items()
                       if k != "pad_token"]
        except (AttributeError, IndexError, ValueError):
            special = []
        if not special:
            for name in ("eos", "eod"):
                with contextlib.suppress(AttributeError, NotImplementedError):
                    special.append(getattr(self.tokenizer, name))
            if self.eod_id is not None:
                special.append(self.eod_id)
        if pad in special:
            warnings.warn(f"pad id {pad} equals another special token id; "
                          + ("keeping it (allow_ambiguous_pad_tokens)"
                             if self.allow_ambiguous_pad_tokens
                             else f"using {DEFAULT_PAD_ID} instead, so tokens in the data that "
                                  "equal it are not masked"), UserWarning, stacklevel=3)
            if not self.allow_ambiguous_pad_tokens:
                pad = DEFAULT_PAD_ID
        return pad


def _check_blend(name: str, blend: Blend) -> None:
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{name}: expected at least one dataset prefix, found none")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(f"{name}: expected one weight per prefix ({len(prefixes)}), found "
                             f"{len(weights)}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"{name}: expected positive weights, found {list(weights)}")
