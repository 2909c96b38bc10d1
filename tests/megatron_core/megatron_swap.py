"""Which megatron-core names the upstream tests get from asynctron, and the rebinding itself.

Applied when conftest.py imports this, before any upstream module is collected, and around
each upstream test; restored after collection and after each test, so the parity tests in the
rest of the suite compare with megatron-core itself. `ASYNCTRON_MEGATRON_SUITE=reference`
leaves megatron-core in place (the same harness on the reference).
"""

from __future__ import annotations

import os
import warnings

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

_ORIGINALS = {key: getattr(key[0], key[1]) for key in swaps()}


def apply() -> None:
    """Rebind each megatron-core name to asynctron's (nothing in reference mode)."""
    if not REFERENCE:
        for (module, name), replacement in swaps().items():
            setattr(module, name, replacement)


def restore() -> None:
    """Give megatron-core its own names back (for the rest of the suite's parity tests)."""
    for (module, name), original in _ORIGINALS.items():
        setattr(module, name, original)


apply()  # before the upstream modules are imported, which bind the names they import
