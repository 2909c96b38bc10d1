"""Large tensors are cut into dim-0 chunks so they spread over bins; small ones stay whole."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.planner import WriteItemType

from asynctron.engine._save_plan import dcp_items
from asynctron.storage.format._chunking import MIN_CHUNK_BYTES, PlannedItem, chunk_large_items
from asynctron.storage.format._plan import flatten, plan_save

MiB = 1 << 20


def _plan(state: dict) -> list[PlannedItem]:
    return dcp_items(plan_save(flatten(state)))


def test_a_dominant_tensor_is_cut_into_one_chunk_per_bin() -> None:
    items = _plan({"big": torch.empty(1000, 48 * 1024, dtype=torch.uint8),
                   "small": torch.empty(4 * MiB, dtype=torch.uint8), "b": b"x"})
    planned = chunk_large_items(items, num_bins=2)
    big = [p for p in planned if p.key == "big"]
    assert [p.rows for p in big] == [(0, 500), (500, 1000)]
    assert [p.chunk() for p in big] == [((500, 49152), (0, 0)), ((500, 49152), (500, 0))]
    assert sum(p.nbytes for p in big) == 1000 * 48 * 1024
    assert {p.key for p in planned if p.rows is None} == {"small", "b"}
    assert next(p for p in planned if p.key == "b").type == WriteItemType.BYTE_IO


def test_small_states_one_bin_and_single_rows_are_never_cut() -> None:
    for state, num_bins in (({"w": torch.empty(100, 1000)}, 4),  # below MIN_CHUNK_BYTES
                            ({"w": torch.empty(64, MiB, dtype=torch.uint8)}, 1),
                            ({"w": torch.empty(1, 128 * MiB, dtype=torch.uint8)}, 4)):
        assert all(p.rows is None for p in chunk_large_items(_plan(state), num_bins))


def test_chunks_are_never_smaller_than_the_minimum() -> None:
    planned = chunk_large_items(_plan({"w": torch.empty(64, MiB, dtype=torch.uint8)}),
                                num_bins=16)
    assert len(planned) == 64 * MiB // MIN_CHUNK_BYTES
    assert all(p.nbytes >= MIN_CHUNK_BYTES for p in planned)


def test_plain_values_plan_as_dcp_plans_them() -> None:
    """A plain tensor or bytes value planned without DCP's planner is the item DCP makes."""
    state = {"w": torch.empty(6, 4, dtype=torch.bfloat16), "b": b"xyz"}
    flat = flatten(state)
    by_dcp = {item.key: item for item in _plan(state)}
    for source, (key, value) in enumerate(flat.values.items()):
        plain = PlannedItem.of_value(source, key, value)
        assert (plain.type, plain.nbytes, plain.dtype, plain.shape, plain.offsets,
                plain.global_shape) == (by_dcp[key].type, by_dcp[key].nbytes, by_dcp[key].dtype,
                                        by_dcp[key].shape, by_dcp[key].offsets,
                                        by_dcp[key].global_shape)
