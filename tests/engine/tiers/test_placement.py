"""The placement of a save to the tiers: each item written once per node that holds it, one
copy for the store, replicas only of what too few nodes hold; different values under one key
refused, naming it. (Across real ranks: tests/distributed/test_tiers_layouts.py.)"""

from __future__ import annotations

import pytest

from asynctron.engine.tiers._config import Nodes
from asynctron.engine.tiers._placement import (
    NODE_COPY,
    REPLICATED,
    STORED,
    LocalItems,
    NodePlacement,
)

KiB = 1 << 10


def _items(*entries: tuple[str, tuple[int, ...], int, str | None]) -> LocalItems:
    """Items of one rank: (key, chunk offsets, bytes, digest); a tensor of 64 float32s, or
    a scalar (no offsets)."""
    return LocalItems(keys=tuple(key for key, _, _, _ in entries),
                      chunks=tuple(((offsets, (nbytes // 4,) if offsets else ())
                                    for _, offsets, nbytes, _ in entries)),
                      shapes=tuple((64,) if offsets else () for _, offsets, _, _ in entries),
                      nbytes=tuple(nbytes for _, _, nbytes, _ in entries),
                      dtypes=("torch.float32",) * len(entries),
                      digests=tuple(digest for _, _, _, digest in entries))


def _assign(plans: list[LocalItems], *, per_node: int, replicas: int
            ) -> list[tuple[int | None, ...]]:
    nodes = Nodes(rank=0, world_size=len(plans), ranks_per_node=per_node, replicas=replicas)
    shares, _ = NodePlacement(nodes, num_bins=2, slab_bytes=1 << 20).assign(plans)
    return shares


def test_a_sharded_tensor_is_replicated_and_stored_by_its_one_holder() -> None:
    """FSDP2: every rank's chunk its own: written by it, sent to the replicas, drained."""
    plans = [_items(("w", (rank * 8,), 32, None)) for rank in range(4)]
    assert _assign(plans, per_node=2, replicas=1) == [(REPLICATED,)] * 4
    assert _assign(plans, per_node=2, replicas=0) == [(STORED,)] * 4


def test_a_replicated_tensor_is_written_once_per_node_and_stored_once() -> None:
    """DDP or HSDP's replicas: every rank holds the same chunk: one writer a node, the first
    of them the store's copy, no replica (the other node's own copy is one)."""
    plans = [_items(("w", (0,), 64 * KiB, None), ("step", (), 4, "00ff")) for _ in range(4)]
    shares = _assign(plans, per_node=2, replicas=1)
    for column in range(2):
        written = [(rank, share[column]) for rank, share in enumerate(shares)
                   if share[column] is not None]
        assert [rank // 2 for rank, _ in written] == [0, 1]  # once per node
        assert sorted(group for _, group in written) == [STORED, NODE_COPY]
    assert shares[0][0] is not None and shares[0][1] is None  # balanced inside a node


def test_what_too_few_nodes_hold_is_replicated_by_its_store_writer() -> None:
    """A chunk two of three nodes hold, with 2 replicas: its store writer sends it."""
    plans = [_items(("w", (0,), 32, None)), _items(("w", (0,), 32, None)),
             _items(("x", (0,), 32, None))]
    shares = _assign(plans, per_node=1, replicas=2)
    assert shares == [(REPLICATED,), (NODE_COPY,), (REPLICATED,)]


@pytest.mark.parametrize(("other", "message"), [
    (("rng", (0,), 16, "1111"), r"tiers: key 'rng' holds different values on ranks 0 and 1 "
                                r"\(16 bytes\); a key names one value of the whole job"),
    (("rng", (), 4, "0000"), r"tiers: key 'rng' is torch\.float32 \[64\] on rank 0 and "
                             r"torch\.float32 \[\] on rank 1"),
])
def test_different_values_under_one_key_are_refused_naming_it(
        other: tuple[str, tuple[int, ...], int, str | None], message: str) -> None:
    plans = [_items(("rng", (0,), 16, "0000")), _items(other)]
    with pytest.raises(ValueError, match=message):
        _assign(plans, per_node=1, replicas=1)


def test_bytes_too_large_to_compare_are_refused_when_their_sizes_differ() -> None:
    """Pickled state past the compared size: ranks that hold different lengths under one key
    hold different values."""
    def pickled(nbytes: int) -> LocalItems:
        return LocalItems(keys=("loader",), chunks=(None,), shapes=(None,), nbytes=(nbytes,),
                          dtypes=(None,), digests=(None,))

    with pytest.raises(ValueError, match=r"key 'loader' holds different values on ranks 0 "
                                         r"and 1 \(1048576 and 1048577 bytes\)"):
        _assign([pickled(1 << 20), pickled((1 << 20) + 1)], per_node=1, replicas=1)
    assert _assign([pickled(1 << 20)] * 2, per_node=1, replicas=1) == [(STORED,), (NODE_COPY,)]
