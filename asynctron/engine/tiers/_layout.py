"""Names on the tiers. A local tier holds shards: each rank's part of a step, committed as a
checkpoint of its own whose manifest says it is a shard (`storage.ShardInfo`); the store holds
one ordinary (global) checkpoint per drained step:

    <local>/step_00000100.rank_00003.of_00004/   rank 3's shard of step 100, saved by 4 ranks
                                                 (manifest.json, __3_*.distcp)
    <local>/step_00000100.rank_00001.of_00004/   a replica another node's rank 1 sent (its
                                                 files that no other node holds)
    <store>/step_00000100/              the whole step: the store writers' files, one manifest,
        rank_00003.manifest.json        and each rank's view (its structure, its stored items)

A shard names its files by its rank, so the store's checkpoint is the shards' stored files side
by side under one manifest: an ordinary checkpoint, every item once, as a multi-rank save
writes it. Each rank's view keeps its structure's own values (a loader's cursor, a step), so a
restore from the store gives every rank its values back.
"""

from __future__ import annotations

import re

_SHARD = re.compile(r"^step_(\d{1,18})\.rank_(\d{1,9})\.of_(\d{1,9})$")
_STEP = re.compile(r"^step_(\d{1,18})$")


def shard_name(step: int, rank: int, world_size: int) -> str:
    """Rank `rank`'s shard of `step`, saved by `world_size` ranks."""
    return f"step_{step:08d}.rank_{rank:05d}.of_{world_size:05d}"


def step_name(step: int) -> str:
    """The store's checkpoint of `step`."""
    return f"step_{step:08d}"


def rank_view(rank: int) -> str:
    """The name of `rank`'s view (its shard's manifest) in a drained step."""
    return f"rank_{rank:05d}.manifest.json"


def parse_shard(name: str) -> tuple[int, int, int] | None:
    """(step, rank, world size) of a shard's name, or None for any other name (a rank at or
    beyond its world's size included)."""
    found = _SHARD.match(name)
    if found is None or int(found[2]) >= int(found[3]):
        return None
    return int(found[1]), int(found[2]), int(found[3])


def parse_step(name: str) -> int | None:
    """The step of a store checkpoint's name, or None for any other name."""
    found = _STEP.match(name)
    return None if found is None else int(found[1])


def join(root: str, name: str) -> str:
    """`name` under `root`, a local path or a URL."""
    return f"{root.rstrip('/')}/{name}"
