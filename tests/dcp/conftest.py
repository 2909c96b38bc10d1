"""Test setup for the DCP plugins."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def collect_after_each_test() -> Iterator[None]:
    """Collect garbage at the end of each test, on the test's thread. A save that fails with
    several writers in flight leaves an asyncio future whose error nobody retrieved (the
    engine's `run_blocking` wraps the executor call of a cancelled writer); asyncio logs it,
    traceback and all, when the future is collected, and on Python 3.11 formatting a
    traceback parses source (`ast.parse`), which races with pytest's own parsing on the main
    thread when the collection happens on the runtime's threads later
    ("AST constructor recursion depth mismatch")."""
    yield
    gc.collect()
