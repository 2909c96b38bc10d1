"""The order methods take turns in, round by round."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def round_order(methods: Sequence[T], round_index: int) -> list[T]:
    """Round `round_index`'s order: as listed in round 0 (the untimed warm-up), then a seeded
    shuffle per round, so that no method always runs right after the same one (a rotation
    keeps every neighbour: whatever the one before leaves behind, such as a deleted file's
    blocks or a worker process, would always land on the same method)."""
    if round_index == 0:
        return list(methods)
    return random.Random(round_index).sample(list(methods), len(methods))
