"""`Tiers`: where an engine's checkpoints live (the node's local tier, replicas in other nodes'
local tiers, a store) and how many of each are kept; `Nodes`: which ranks share a local tier,
and which ranks hold whose replicas."""

from __future__ import annotations

import logging
import os
import string
from dataclasses import dataclass

from asynctron import _knobs
from asynctron.storage.backends import served_scheme

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Tiers:
    """The tiers of an engine's checkpoints: `Engine(tiers=Tiers(local=..., store=...))`.

    Every `engine.save(state, step=N)` commits each rank's shard into its node's local tier
    and `replicas` other nodes' local tiers; every `store_every`-th complete step is drained
    to `store` in the background; `engine.restore(state)` reads each rank's shard from the
    nearest tier that verifies.
    """

    local: str
    """The node-local root (NVMe, or /dev/shm), never a shared file system. `{node}` in it is
    the node's index, so several "nodes" on one machine get their own (tests, benchmarks)."""
    store: str | None = None
    """The persistent tier: any backend's URL (`s3://bucket/run`; its scheme registered before
    the Tiers is made) or a shared path; None: no store (only local tiers and replicas). A
    URL `backend_for` refuses (`s3//bucket/run`, `gcs://bucket/run`) is refused here."""
    replicas: int = 1
    """How many other nodes keep a copy of what only one node holds (a job of fewer nodes
    keeps as many as it has other nodes)."""
    store_every: int = 10
    """Drain every `store_every`-th complete step to the store (and the next one after a
    drain that failed)."""
    keep_local: int = 2
    """Complete steps each local tier keeps (its own shards and the replicas it holds)."""
    keep_store: int | None = None
    """Steps the store keeps (None: all); the others this job drained are pruned."""

    def __post_init__(self) -> None:
        for name in ("local", "store"):
            value = getattr(self, name)
            if value is None and name == "store":
                continue
            if not isinstance(value, str | os.PathLike) or not os.fspath(value):
                raise ValueError(f"Tiers.{name}: expected a non-empty path or URL, found "
                                 f"{value!r}")
            object.__setattr__(self, name, os.fspath(value))
        if self.store is not None:
            try:
                served_scheme(self.store)
            except ValueError as error:
                raise ValueError(f"Tiers.store: {error}") from error
        fields = {field for _, field, _, _ in string.Formatter().parse(self.local)
                  if field is not None}
        if fields - {"node"}:
            raise ValueError(f"Tiers.local: expected a path whose only placeholder is {{node}}, "
                             f"found {sorted(fields - {'node'})} in {self.local!r}")
        for name, least in (("replicas", 0), ("store_every", 1), ("keep_local", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Tiers.{name}: expected an int >= {least}, found {value!r}")
        if self.keep_store is not None and (isinstance(self.keep_store, bool) or not isinstance(
                self.keep_store, int) or self.keep_store < 1):
            raise ValueError(f"Tiers.keep_store: expected None or an int >= 1, found "
                             f"{self.keep_store!r}")

    def local_root(self, node: int) -> str:
        """Node `node`'s local tier."""
        return self.local.format(node=node)


@dataclass(frozen=True, slots=True)
class Nodes:
    """The job's nodes: ranks `[k * ranks_per_node, (k + 1) * ranks_per_node)` share node `k`'s
    local tier. Rank r's replicas are held by the same local rank on the next `replicas` nodes
    (wrapping around), so a node's loss costs each shard one copy."""

    rank: int
    world_size: int
    ranks_per_node: int
    replicas: int = 0
    """Other nodes that keep a copy of what only one node holds: `Tiers.replicas`, or fewer
    where the job has fewer other nodes."""

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def holders(self, rank: int) -> list[int]:
        """The ranks that keep `rank`'s replicas, nearest node first."""
        return [(rank + j * self.ranks_per_node) % self.world_size
                for j in range(1, self.replicas + 1)]

    def sources(self, rank: int) -> list[int]:
        """The ranks whose replicas `rank` keeps."""
        return [(rank - j * self.ranks_per_node) % self.world_size
                for j in range(1, self.replicas + 1)]


def job_nodes(tiers: Tiers, rank: int, world_size: int) -> Nodes:
    """The nodes of this job, from `ASYNCTRON_RANKS_PER_NODE`, else torchrun's
    `LOCAL_WORLD_SIZE`, else one node of every rank. A job of fewer nodes than
    `Tiers.replicas + 1` (restarted on fewer, say) keeps as many replicas as it has other nodes,
    and says so in the log.

    Raises:
        ValueError: the world is not whole nodes, or nodes simulated on one machine
            (`ASYNCTRON_RANKS_PER_NODE`) sharing one local tier (no `{node}` in
            `Tiers.local`).
    """
    per_node, simulated = _knobs.ranks_per_node(world_size)
    if world_size % per_node:
        raise ValueError(f"ranks per node: expected a divisor of the world size {world_size}, "
                         f"found {per_node}; set {_knobs.RANKS_PER_NODE} (or LOCAL_WORLD_SIZE) "
                         "to the ranks that share a node")
    num_nodes = world_size // per_node
    replicas = min(tiers.replicas, num_nodes - 1)
    if replicas < tiers.replicas and rank == 0:
        logger.warning("Tiers.replicas=%d, but the job has %d node%s: keeping %d replica%s "
                       "(a node lost before the next drain loses what only it held; "
                       "replicas=%d says so without this warning)", tiers.replicas, num_nodes,
                       "" if num_nodes == 1 else "s", replicas, "" if replicas == 1 else "s",
                       replicas)
    if simulated and num_nodes > 1 and "{node}" not in tiers.local:
        raise ValueError(f"Tiers.local: {_knobs.RANKS_PER_NODE} makes {num_nodes} nodes "
                         f"on one machine, so each needs its own local tier; found "
                         f"{tiers.local!r} without {{node}}; add it, e.g. "
                         f"{tiers.local}/node{{node}}")
    return Nodes(rank, world_size, per_node, replicas)
