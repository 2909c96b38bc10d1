"""megatron's subclasses of `GPTDatasetConfig`, written as megatron writes them, on ours.

`GPTFIMDatasetConfig` (Megatron-LM megatron/training/datasets/fim_dataset.py) and
`MultimodalDatasetConfig` (megatron/core/datasets/multimodal_dataset.py), tag core_v0.16.1:
plain `@dataclass` subclasses that add fields with defaults; the multimodal one checks its own
fields in `__post_init__` after `super().__post_init__()`. tests/megatron_core runs megatron's
own modules on the swapped config.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from asynctron.datasets import GPTDataset, GPTDatasetConfig, MockGPTDataset, build_gpt_datasets


@dataclass
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """Megatron-LM's, fields and defaults as upstream (`Dict` reads `dict`)."""

    fim_rate: float = None
    """Probability to convert a training sample into a FIM format"""

    fim_spm_rate: float = None
    """Probability that the a FIM sample uses the SPM format over the PSM format"""

    fim_extra_tokens: dict = None
    """FIM extra tokens. Should consist of prefix, middle, suffix, PAD, and EOD tokens."""

    fim_split_sample: str | None = None
    """String around which to split the sample for FIM"""

    fim_fragment_rate: float | None = None
    """Rate of FIM on each fragment when split_sample is not None"""

    fim_no_prefix: str | None = None
    """Do not apply FIM to fragments that start with this prefix"""


@dataclass
class MultimodalDatasetConfig(GPTDatasetConfig):
    """megatron-core's, fields, defaults and `__post_init__` as upstream."""

    image_h: int = None
    """Image height."""

    image_w: int = None
    """Image width."""

    preprocess_func: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda x: x
    """Optional function to preprocess data samples for a specific model."""

    def __post_init__(self) -> None:
        super().__post_init__()

        assert self.image_h is not None
        assert self.image_w is not None


FIM_TOKENS = {"prefix": "<prefix>", "middle": "<middle>", "suffix": "<suffix>", "pad": "<pad>",
              "eod": "<eod>"}


def _megatron_data_args(prefix: str, cache: str, tok: object) -> dict[str, object]:
    """pretrain_gpt.py's `core_gpt_dataset_config_from_args` arguments that asynctron has."""
    return {
        "random_seed": 1234, "sequence_length": 32, "blend": ([prefix], None),
        "blend_per_split": None, "split": "8,1,1", "num_dataset_builder_threads": 1,
        "path_to_cache": cache, "mmap_bin_files": True, "tokenizer": tok,
        "reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True,
        "create_attention_mask": True, "object_storage_cache_path": None,
        "mid_level_dataset_surplus": 0.005, "allow_ambiguous_pad_tokens": False,
        "fast_cache_load": False, "sequences_per_dataset": None, "defer_npy_index_mmap": False,
    }


def test_fim_config_takes_megatrons_arguments_and_builds_gpt_datasets(
        make_corpus, tmp_path, tok) -> None:
    prefix = make_corpus("fim", num_documents=150, eod=0).path_prefix
    fim = GPTFIMDatasetConfig(
        **_megatron_data_args(prefix, str(tmp_path / "fim-cache"), tok), fim_rate=1.0,
        fim_spm_rate=0.5, fim_extra_tokens=FIM_TOKENS, fim_split_sample=None,
        fim_fragment_rate=1.0, fim_no_prefix=None)
    assert (fim.fim_rate, fim.fim_extra_tokens, fim.split) == (1.0, FIM_TOKENS, "8,1,1")
    assert not fim.mock and fim.eod == 0
    plain = GPTDatasetConfig(**_megatron_data_args(prefix, str(tmp_path / "cache"), tok))

    built = build_gpt_datasets(fim, [40, 4, None])
    assert [type(ds) for ds in built] == [GPTDataset, GPTDataset, GPTDataset]
    assert all(ds.config is fim for ds in built)
    expected = build_gpt_datasets(plain, [40, 4, None])
    for ours, theirs in zip(built, expected, strict=True):
        assert len(ours) == len(theirs)
        for i in (0, len(ours) - 1):
            for key, value in theirs[i].items():
                assert torch.equal(ours[i][key], value), key


def test_subclasses_keep_our_validation_before_their_own() -> None:
    with pytest.raises(ValueError, match=r"^sequence_length: expected >= 2, found 1$"):
        GPTFIMDatasetConfig(random_seed=1, sequence_length=1, fim_rate=0.5)
    with pytest.raises(ValueError, match=r"^sequence_length: expected >= 2, found 1$"):
        MultimodalDatasetConfig(random_seed=1, sequence_length=1, image_h=2, image_w=2)
    with pytest.raises(AssertionError):  # megatron's own check, after ours passed
        MultimodalDatasetConfig(random_seed=1, sequence_length=8, image_w=2)


def test_multimodal_config_builds_mock_datasets(tok) -> None:
    config = MultimodalDatasetConfig(
        random_seed=1234, sequence_length=64, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=True, image_h=336, image_w=336,
        split="990,9,1", tokenizer=tok, mid_level_dataset_surplus=0.005)
    assert (config.image_h, config.image_w, config.preprocess_func(7)) == (336, 336, 7)
    built = build_gpt_datasets(config, [10, 10, 10])
    assert [type(ds) for ds in built] == [MockGPTDataset] * 3
    assert built[0][0]["tokens"].shape == (64,)


def test_the_config_and_its_subclasses_are_read_only() -> None:
    base = GPTDatasetConfig(random_seed=1, sequence_length=8)
    fim = GPTFIMDatasetConfig(random_seed=1, sequence_length=8, fim_rate=0.5)
    for config, name in ((base, "sequence_length"), (fim, "sequence_length"),
                         (fim, "fim_rate")):
        with pytest.raises(dataclasses.FrozenInstanceError,
                           match=rf"^cannot assign to field '{name}': the config is read-only"):
            setattr(config, name, 4)
        with pytest.raises(dataclasses.FrozenInstanceError,
                           match=rf"^cannot delete field '{name}'"):
            delattr(config, name)
    with pytest.raises(dataclasses.FrozenInstanceError,
                       match=r"^cannot assign to 'sequence_lenght': not a field of "
                             r"GPTFIMDatasetConfig; declare it"):
        fim.sequence_lenght = 4
    assert (base.sequence_length, fim.fim_rate) == (8, 0.5)
    assert hash(base) == hash(GPTDatasetConfig(random_seed=1, sequence_length=8))


def test_replace_and_pickle_keep_the_subclass_and_its_checks() -> None:
    fim = GPTFIMDatasetConfig(random_seed=1, sequence_length=8, fim_rate=0.5)
    changed = dataclasses.replace(fim, fim_rate=0.25)
    assert type(changed) is GPTFIMDatasetConfig and changed.fim_rate == 0.25
    with pytest.raises(ValueError, match=r"^sequence_length: expected >= 2, found 1$"):
        dataclasses.replace(fim, sequence_length=1)
    copied = pickle.loads(pickle.dumps(fim))
    assert copied == fim
    with pytest.raises(dataclasses.FrozenInstanceError):
        copied.fim_rate = 0.0


def test_a_subclass_sets_a_derived_field_once_in_post_init() -> None:
    @dataclass
    class Derived(GPTDatasetConfig):
        tokens_per_sample: int = dataclasses.field(init=False, default=0)

        def __post_init__(self) -> None:
            super().__post_init__()
            self.tokens_per_sample = self.sequence_length + int(self.add_extra_token_to_sequence)

    config = Derived(random_seed=1, sequence_length=8)
    assert config.tokens_per_sample == 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tokens_per_sample = 10
