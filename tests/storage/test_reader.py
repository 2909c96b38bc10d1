"""Read planning: neighbouring items share one call, far ones do not, big ones stream."""

from __future__ import annotations

from asynctron.storage._manifest import ItemRecord
from asynctron.storage._reader import MAX_GAP_BYTES, plan_reads


def _record(key: str, offset: int, nbytes: int) -> ItemRecord:
    return ItemRecord(key, "bytes", None, None, None, None, "__0_0.distcp", offset, nbytes, None)


def test_neighbours_share_a_call_and_far_items_do_not() -> None:
    records = [_record("a", 0, 100), _record("b", 4096, 100),
               _record("c", 4096 + MAX_GAP_BYTES + 4096, 10)]
    batches = plan_reads(records, call_nbytes=1 << 20)
    assert [(b.file_offset, b.nbytes) for b in batches] == [(0, 4196), (4096 + MAX_GAP_BYTES
                                                                        + 4096, 10)]
    assert [(s.item_index, s.batch_offset, s.nbytes) for s in batches[0].segments] == [
        (0, 0, 100), (1, 4096, 100)]


def test_a_large_item_streams_in_calls_of_at_most_call_nbytes() -> None:
    batches = plan_reads([_record("a", 8192, 10_000)], call_nbytes=4096)
    assert [(b.file_offset, b.nbytes) for b in batches] == [
        (8192, 4096), (12288, 4096), (16384, 1808)]
    assert [s.item_offset for b in batches for s in b.segments] == [0, 4096, 8192]


def test_empty_items_need_no_call() -> None:
    assert plan_reads([_record("a", 0, 0), _record("b", 0, 0)], call_nbytes=4096) == []
