"""Names on the tiers. A local tier is a root of ordinary asynctron checkpoints, one per rank
shard and step; the store holds one ordinary (global) checkpoint per drained step:

    <local>/step_00000100.rank_00003/   rank 3's shard of step 100 (manifest.json, __3_*.distcp)
    <local>/step_00000100.rank_00001/   a replica another node's rank 1 sent
    <store>/step_00000100/              the whole step: every rank's files, one manifest,
        rank_00003.manifest.json        and each rank's own view of them (its shard's)

A shard names its files by its rank, so the store's checkpoint is the shards' files side by
side under one manifest: an ordinary checkpoint, where an item several ranks hold (the same
key and chunk) is listed once, as a multi-rank save lists it. Each rank's view keeps what was
its own (an RNG state, a loader's cursor under a key every rank uses), so a restore from the
store gives every rank its state bit for bit.
"""

from __future__ import annotations

import re

_SHARD = re.compile(r"^step_(\d{1,18})\.rank_(\d{1,9})$")
_STEP = re.compile(r"^step_(\d{1,18})$")


def shard_name(step: int, rank: int) -> str:
    return f"step_{step:08d}.rank_{rank:05d}"


def step_name(step: int) -> str:
    """The store's checkpoint of `step`."""
    return f"step_{step:08d}"


def rank_view(rank: int) -> str:
    """The name of `rank`'s view (its shard's manifest) in a drained step."""
    return f"rank_{rank:05d}.manifest.json"


def parse_shard(name: str) -> tuple[int, int] | None:
    """(step, rank) of a shard's name, or None for any other name."""
    found = _SHARD.match(name)
    return None if found is None else (int(found[1]), int(found[2]))


def parse_step(name: str) -> int | None:
    """The step of a store checkpoint's name, or None for any other name."""
    found = _STEP.match(name)
    return None if found is None else int(found[1])


def join(root: str, name: str) -> str:
    """`name` under `root`, a local path or a URL."""
    return f"{root.rstrip('/')}/{name}"
