"""Which rank writes which item of a save to the tiers, and where each file goes.

A key names one value of the whole job, as in any multi-rank save: the same key and chunk on
two ranks is one replicated value (a `Replicate()` DTensor, HSDP's replica dimension, a
DDP model's plain tensors, an optimizer's step). So each item is written once per node that
holds it (by the rank of that node with the fewest bytes so far), and one of those writers,
the item's *store writer*, keeps the copy a drain uploads. Each writer sorts its items into
three groups of files (`file_group` tells a file's):

    REPLICATED  the store writer's items no more than `replicas` nodes hold: its files are
                also streamed to the holder nodes (the replicas) and drained to the store;
    STORED      the store writer's items enough nodes hold already: drained, not streamed;
    NODE_COPY   the other nodes' copies: kept on the node only.

So a node's tier holds one copy of what its ranks need, the replicas only what no other node
has, and the store each item once (1x the state, whatever the world). An FSDP2 state (every
chunk on one rank) is all REPLICATED; a data-parallel state or HSDP's replicas, held by every
node, is STORED on one rank and a NODE_COPY on the others.

Small values (up to `CHECKED_BYTES`) that several ranks hold under one key are compared when
the plan is made: different values under one key (each rank's RNG state, say) would be
restored as one of them on every rank, so the save refuses them, naming the key, rather than
keep one silently.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from asynctron._memory import tensor_bytes
from asynctron.engine._plan_cache import structure_signature
from asynctron.engine._save_plan import file_group
from asynctron.engine.tiers._config import Nodes
from asynctron.storage import Manifest
from asynctron.storage.format import (
    PLAIN_TENSORS,
    FlatStateDict,
    PlannedItem,
    ShardInfo,
    digest,
    encode_manifest,
)

REPLICATED, STORED, NODE_COPY = 0, 1, 2
"""The groups of a shard's items (and files), see the module docstring."""

CHECKED_BYTES = 64 << 10
"""Values up to this size that several ranks hold under one key are compared at planning."""

Chunk = tuple[tuple[int, ...], tuple[int, ...]] | None
"""(offsets, sizes) of a tensor item's chunk in its global tensor; None for bytes."""


@dataclass(frozen=True, slots=True)
class LocalItems:
    """One rank's items, as the placement compares them across ranks: per item its key, its
    chunk, its global shape (None for bytes), its bytes, its dtype (None for bytes) and, for
    a small one, its digest."""

    keys: tuple[str, ...]
    chunks: tuple[Chunk, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    nbytes: tuple[int, ...]
    dtypes: tuple[str | None, ...]
    digests: tuple[str | None, ...]


class NodePlacement:
    """The placement of one rank's saves to the tiers (`engine._save.Placement`)."""

    def __init__(self, nodes: Nodes, *, num_bins: int, slab_bytes: int) -> None:
        self._nodes = nodes
        self._num_bins = num_bins
        self._slab_bytes = slab_bytes

    def signature(self, flat: FlatStateDict) -> str | None:
        signature = structure_signature(flat, num_bins=self._num_bins, rank=self._nodes.rank,
                                        slab_bytes=self._slab_bytes, dtensors=True)
        if signature is None:
            return None
        nodes = self._nodes
        return f"tiers {nodes.world_size}/{nodes.ranks_per_node}/{nodes.replicas}\n{signature}"

    def local_plan(self, flat: FlatStateDict) -> LocalItems:
        """Blocks (a step per item, a digest per small one).

        Raises:
            TypeError: a value the tiers cannot place (a tensor subclass other than DTensor).
        """
        keys, chunks, shapes, nbytes, dtypes, digests = [], [], [], [], [], []
        for key, value in flat.values.items():
            keys.append(key)
            if isinstance(value, bytes):
                chunks.append(None)
                shapes.append(None)
                nbytes.append(len(value))
                dtypes.append(None)
                digests.append(_digest(value) if len(value) <= CHECKED_BYTES else None)
                continue
            local = _local(key, value)
            chunks.append(_chunk(value))
            shapes.append(tuple(value.shape))
            size = local.numel() * local.dtype.itemsize
            nbytes.append(size)
            dtypes.append(str(value.dtype))
            digests.append(_digest(local) if size <= CHECKED_BYTES else None)
        return LocalItems(tuple(keys), tuple(chunks), tuple(shapes), tuple(nbytes),
                          tuple(dtypes), tuple(digests))

    def assign(self, plans: list[LocalItems]) -> tuple[list[tuple[int | None, ...]], None]:
        """On the coordinator: per rank, per item, the group it writes the item in, or None
        (another rank of its node writes it). Deterministic: the same plans, the same shares.

        Raises:
            ValueError: ranks hold different values under one key and chunk (naming it).
        """
        holders: dict[tuple[str, Chunk], list[tuple[int, int]]] = {}
        first: dict[str, tuple[int, int]] = {}
        for rank, plan in enumerate(plans):
            for index, identity in enumerate(zip(plan.keys, plan.chunks, strict=True)):
                holders.setdefault(identity, []).append((rank, index))
                seen = first.setdefault(identity[0], (rank, index))
                _check_kind(identity[0], seen, (rank, index), plans)
        node_bytes = [0] * len(plans)
        store_bytes = [0] * len(plans)
        shares: list[list[int | None]] = [[None] * len(plan.keys) for plan in plans]
        node_of = self._nodes.node_of
        for (key, chunk), where in holders.items():
            _check_same(key, chunk, where, plans)
            size = max(plans[where[0][0]].nbytes[where[0][1]], 1)
            by_node: dict[int, list[tuple[int, int]]] = {}
            for rank, index in where:
                by_node.setdefault(node_of(rank), []).append((rank, index))
            writers = [min(candidates, key=lambda c: node_bytes[c[0]])
                       for candidates in by_node.values()]
            for rank, _ in writers:
                node_bytes[rank] += size
            store = min(writers, key=lambda c: store_bytes[c[0]])
            store_bytes[store[0]] += size
            replicated = 0 < len(by_node) <= self._nodes.replicas
            for rank, index in writers:
                shares[rank][index] = NODE_COPY if (rank, index) != store else (
                    REPLICATED if replicated else STORED)
        return [tuple(share) for share in shares], None

    def items(self, flat: FlatStateDict, plan: LocalItems,
              share: tuple[int | None, ...]) -> list[PlannedItem]:
        """Blocks: the items this rank writes, each in its group."""
        values = flat.values
        return [PlannedItem.of_value(index, key, values[key], group=group)
                for index, (key, group) in enumerate(zip(plan.keys, share, strict=True))
                if group is not None]

    def shard(self, files: Sequence[str]) -> ShardInfo:
        return ShardInfo(rank=self._nodes.rank, world_size=self._nodes.world_size,
                         store_files=tuple(name for name in files if self.is_stored(name)))

    def is_replicated(self, name: str) -> bool:
        """Whether the file `name` goes to the replicas."""
        return file_group(name, self._num_bins) == REPLICATED

    def is_stored(self, name: str) -> bool:
        """Whether the file `name` goes to the store."""
        return file_group(name, self._num_bins) in (REPLICATED, STORED)


def _local(key: str, value: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor value this rank holds: a DTensor's local chunk, or the tensor."""
    if type(value) is DTensor:
        return value.to_local()
    if type(value) in PLAIN_TENSORS:
        return value
    raise TypeError(f"tiers: key {key!r}: expected a tensor, a DTensor, an ndarray or bytes, "
                    f"found {type(value).__module__}.{type(value).__qualname__}; save its "
                    "plain tensors (or DTensors) instead")


def _chunk(value: torch.Tensor) -> Chunk:
    if isinstance(value, DTensor):
        (chunk,) = value.__create_chunk_list__()
        return tuple(chunk.offsets), tuple(chunk.sizes)
    return (0,) * value.dim(), tuple(value.shape)


def _digest(value: torch.Tensor | bytes) -> str:
    if isinstance(value, bytes):
        return digest(memoryview(value))
    data = value.detach().to("cpu").contiguous()
    return digest(tensor_bytes(data) if data.numel() else memoryview(b""))


def _check_kind(key: str, first: tuple[int, int], other: tuple[int, int],
                plans: list[LocalItems]) -> None:
    """Two ranks' items of one key are of one kind, dtype and global shape."""
    (first_rank, first_index), (rank, index) = first, other
    if (plans[rank].dtypes[index], plans[rank].shapes[index]) != (
            plans[first_rank].dtypes[first_index], plans[first_rank].shapes[first_index]):
        raise ValueError(
            f"tiers: key {key!r} is {_what(plans[first_rank], first_index)} on rank "
            f"{first_rank} and {_what(plans[rank], index)} on rank {rank}; a key names one "
            "value of the whole job: every rank that holds it must hold the same")


def _check_same(key: str, chunk: Chunk, where: list[tuple[int, int]],
                plans: list[LocalItems]) -> None:
    """Every rank holding `key`'s `chunk` holds as many bytes and (when small enough to
    compare) the same bytes."""
    first_rank, first_index = where[0]
    first = plans[first_rank]
    at = "" if chunk is None or not any(chunk[0]) else f" chunk at {list(chunk[0])}"
    for rank, index in where[1:]:
        plan = plans[rank]
        sizes = sorted({first.nbytes[first_index], plan.nbytes[index]})
        if (plan.nbytes[index], plan.digests[index]) != (first.nbytes[first_index],
                                                         first.digests[first_index]):
            raise ValueError(
                f"tiers: key {key!r}{at} holds different values on ranks {first_rank} and "
                f"{rank} ({' and '.join(map(str, sizes))} bytes); a key names one value of the "
                "whole job, kept once, so a restore would give every rank one of them: give "
                "state that differs per rank its own key on each rank (e.g. "
                f"'{key}.rank{rank}' on rank {rank}), or make it one DTensor")


def _what(plan: LocalItems, index: int) -> str:
    shape = plan.shapes[index]
    return (f"{plan.nbytes[index]} bytes" if shape is None
            else f"{plan.dtypes[index]} {list(shape)}")


def part_of(manifest: Manifest, files: Collection[str], *, stored: bool) -> bytes:
    """Blocks (CPU): the manifest of a shard's part in `files` (its items there, its whole
    structure); a part the store keeps (`stored`: a rank's view there) names them its store
    files, a replica none."""
    kept = set(files)
    shard = manifest.shard
    assert shard is not None
    return encode_manifest(
        structure=json.dumps(manifest.structure, separators=(",", ":")),
        items=[item for item in manifest.items if item.file in kept], checksums=None,
        files={name: size for name, size in manifest.files.items() if name in kept},
        created_unix_s=manifest.created_unix_s, checksum=manifest.checksum,
        shard=ShardInfo(rank=shard.rank, world_size=shard.world_size,
                        store_files=tuple(name for name in manifest.files
                                          if name in kept) if stored else ()))
