"""Fuzz test setup: one hypothesis profile for every fuzz test, and a scratch directory.

`ASYNCTRON_FUZZ_EXAMPLES` sets the examples per test (100 by default, a few seconds each); a
long run is `ASYNCTRON_FUZZ_EXAMPLES=20000 pytest tests/fuzz -o faulthandler_timeout=0` (the
option stops the stack dumps every two minutes; each test's time limit grows with the count).
No example database is kept, and hypothesis' home (where its pytest plugin caches the constants
of our source while collecting) is the system's temporary directory, so nothing is written to
the source tree.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.configuration import set_hypothesis_home_dir

EXAMPLES = int(os.environ.get("ASYNCTRON_FUZZ_EXAMPLES", "100"))

# at import, so before hypothesis' pytest plugin writes its cache while collecting
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "asynctron-hypothesis"))
settings.register_profile(
    "asynctron-fuzz", max_examples=EXAMPLES, deadline=None, database=None,
    phases=[phase for phase in Phase if phase != Phase.explain],  # tracing every line: slow
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("asynctron-fuzz")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.timeout(300 + EXAMPLES // 5))


@pytest.fixture(scope="module")
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="asynctron-fuzz-")
    yield path
    shutil.rmtree(path, ignore_errors=True)
