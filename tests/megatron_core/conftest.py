"""Megatron-LM's own data tests, run with asynctron's datasets in place of megatron-core's.

The tests and the tools they drive are Megatron-LM's, tag core_v0.16.1 (README.md here lists the
files and every line changed). Before any of them is imported, each megatron-core name below is
rebound to asynctron's class, so the tests, `tools/preprocess_data.py`,
`tools/merge_datasets.py` and `tools/build_sequences_per_dataset.py` build, read and blend
through asynctron. `ASYNCTRON_MEGATRON_SUITE=reference` runs them on megatron-core itself.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import asynctron.datasets as ours

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's import warns on CPU (no TE, no Apex, jit)
    import megatron.core.datasets.blended_dataset as megatron_blended
    import megatron.core.datasets.blended_megatron_dataset_builder as megatron_builder
    import megatron.core.datasets.gpt_dataset as megatron_gpt
    import megatron.core.datasets.indexed_dataset as megatron_indexed
    import megatron.core.datasets.utils as megatron_utils

REFERENCE = os.environ.get("ASYNCTRON_MEGATRON_SUITE") == "reference"

def swaps() -> dict[tuple[object, str], object]:
    """(megatron-core module, name) -> what the tests get instead."""
    return {
        (megatron_indexed, "IndexedDataset"): ours.IndexedDataset,
        (megatron_indexed, "IndexedDatasetBuilder"): ours.IndexedDatasetBuilder,
        (megatron_indexed, "_IndexReader"): ours.DatasetIndex,
        (megatron_gpt, "GPTDataset"): ours.GPTDataset,
        (megatron_gpt, "GPTDatasetConfig"): ours.GPTDatasetConfig,
        (megatron_gpt, "MockGPTDataset"): ours.MockGPTDataset,
        (megatron_blended, "BlendedDataset"): ours.BlendedDataset,
        (megatron_builder, "BlendedMegatronDatasetBuilder"): ours.BlendedMegatronDatasetBuilder,
        (megatron_utils, "Split"): ours.Split,
    }


# Compiled parts are built at install, asynctron's and the megatron-core wheel's alike (which
# ships helpers_cpp without the Makefile compile_helpers runs): there is nothing to compile.
megatron_utils.compile_helpers = lambda: None
if not REFERENCE:
    for (module, name), replacement in swaps().items():
        assert hasattr(module, name), f"megatron-core has no {module.__name__}.{name}"
        setattr(module, name, replacement)

#: upstream tests that need files from a hub, with why
NEEDS_THE_HUB = {
    "test_preprocess_data_gpt": "GPT-2's vocab and merges from the hub (/opt/data); "
                                "test_megatron_tools.py runs the same checks on a local vocab",
    "test_preprocess_data_bert": "BERT's vocab from the hub and nltk's punkt model",
}


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("flaky", "flaky_in_dev"):  # Megatron-LM's CI markers, used by the tests
        config.addinivalue_line("markers", f"{marker}: Megatron-LM CI marker (no effect here)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        reason = NEEDS_THE_HUB.get(item.name)
        if reason is not None and "megatron_core" in str(item.path):
            item.add_marker(pytest.mark.skip(reason=f"needs {reason}"))


@pytest.fixture(scope="package", autouse=True)
def _close_the_process_group():
    """The upstream tests start a one-rank gloo group; the rest of the suite must not see it."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """Megatron-LM's conftest fixture: a directory the tests' ranks share (one rank here)."""
    return tmp_path_factory.mktemp("tmp_dist_ckpt")
