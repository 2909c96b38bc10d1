"""Megatron-LM's own data tests, run with asynctron's datasets in place of megatron-core's.

The tests and the tools they drive are Megatron-LM's, tag core_v0.16.1 (README.md here lists the
files and every line changed). `megatron_swap` rebinds megatron-core's dataset names to
asynctron's before any of them is imported; `ASYNCTRON_MEGATRON_SUITE=reference` runs them on
megatron-core itself.
"""

from __future__ import annotations

import os
import sys

import megatron_swap  # rebinds megatron-core's names to asynctron's, for collection
import pytest
import torch

# Megatron-LM's test packages, imported as `unit_tests` (README.md: `tests` is this suite's)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "tests"))

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


def pytest_collection_finish(session: pytest.Session) -> None:
    megatron_swap.restore()


@pytest.fixture(autouse=True)
def _asynctron_in_place_of_megatron():
    """The swap around each test; and the one-rank gloo group an upstream test starts is closed
    after it, so the rest of the suite never sees it."""
    megatron_swap.apply()
    yield
    megatron_swap.restore()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """Megatron-LM's conftest fixture: a directory the tests' ranks share (one rank here)."""
    return tmp_path_factory.mktemp("tmp_dist_ckpt")
