"""The splitter reproduces seed 000's worked examples (Megatron's `_split_by_size_and_type`)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from asynctron.storage import split_by_size_and_type


def _bytes_item(name: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)


def _tensor_item(name: str, numel: int, global_numel: int | None = None) -> WriteItem:
    size = torch.Size([global_numel or numel])
    return WriteItem(
        index=MetadataIndex(name, torch.Size([0])),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([numel])),
            properties=TensorProperties(dtype=torch.uint8),
            size=size,
        ),
    )


def _local_bytes(item: WriteItem) -> int:
    return 0 if item.tensor_data is None else int(item.tensor_data.chunk.sizes.numel())


def _names(bins: list[list[WriteItem]]) -> list[list[str]]:
    return [[item.index.fqn for item in b] for b in bins]


def test_seed_example_one() -> None:
    """Seed 000 §2: 3 bins, 6 items → [item1,item2] [item3,item5] [item6,item4]."""
    items = [_bytes_item("item1"), _tensor_item("item2", 1000), _bytes_item("item3"),
             _tensor_item("item4", 500), _tensor_item("item5", 800), _bytes_item("item6")]
    bins = split_by_size_and_type(3, items, _local_bytes)
    assert _names(bins) == [["item1", "item2"], ["item3", "item5"], ["item6", "item4"]]


def test_seed_example_two() -> None:
    """Seed 000 §4: bytes do not weigh in the heap; item8 (300) lands on bin1."""
    items = [_bytes_item("item1"), _tensor_item("item2", 2000), _bytes_item("item3"),
             _tensor_item("item4", 1500), _tensor_item("item5", 1000), _tensor_item("item6", 500),
             _bytes_item("item7"), _tensor_item("item8", 300)]
    bins = split_by_size_and_type(3, items, _local_bytes)
    assert _names(bins) == [["item1", "item2"], ["item3", "item4", "item8"],
                            ["item7", "item5", "item6"]]


def test_sizes_are_local_chunks_not_global_tensors() -> None:
    """Megatron's fix: a small shard of a huge tensor weighs its shard size."""
    items = [_tensor_item("shard_of_huge", 10, global_numel=10**9),
             _tensor_item("big", 900), _tensor_item("medium", 800)]
    bins = split_by_size_and_type(2, items, _local_bytes)
    assert _names(bins) == [["big"], ["medium", "shard_of_huge"]]


def test_one_bin_keeps_order_and_more_bins_than_items_leave_empties() -> None:
    items = [_tensor_item("a", 1), _bytes_item("b")]
    assert _names(split_by_size_and_type(1, items, _local_bytes)) == [["a", "b"]]
    assert _names(split_by_size_and_type(4, items, _local_bytes)) == [["b", "a"], [], [], []]
