"""IndexedDatasetBuilder: megatron's calls, bounded memory, merges, clean failure."""

from __future__ import annotations

import os
import re
import tracemalloc

import numpy as np
import pytest
import torch

from asynctron.datasets import IndexedDataset, IndexedDatasetBuilder
from asynctron.datasets.formats._builder import write_indexed_dataset
from asynctron.testing import FaultyBackend


def test_add_index_merges_sequences_and_documents(tmp_path) -> None:
    write_indexed_dataset(str(tmp_path / "a"), [[1, 2], [3]], dtype=np.int32)
    b = IndexedDatasetBuilder(str(tmp_path / "b.bin"), dtype=np.int32)
    b.add_document([4, 5, 6], [1, 2])
    b.finalize(str(tmp_path / "b.idx"))
    merged = IndexedDatasetBuilder(str(tmp_path / "ab.bin"), dtype=np.int32)
    merged.add_item([9])
    merged.end_document()
    merged.add_index(str(tmp_path / "a"))
    merged.add_index(str(tmp_path / "b"))
    merged.finalize(str(tmp_path / "ab.idx"))
    ds = IndexedDataset(str(tmp_path / "ab"))
    assert [x.tolist() for x in ds] == [[9], [1, 2], [3], [4], [5, 6]]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 5]


def test_add_index_refuses_another_dtype(tmp_path) -> None:
    write_indexed_dataset(str(tmp_path / "a"), [[1]], dtype=np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "b.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match=r"^dataset .*a: expected dtype int32, found uint16; "
                                         r"merge datasets of one token dtype$"):
        builder.add_index(str(tmp_path / "a"))
    builder.abort()


def test_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^token dtype 'complex64': expected one of"):
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.complex64)
    assert not os.path.exists(tmp_path / "x.bin")
    builder = IndexedDatasetBuilder(str(tmp_path / "y.bin"))
    with pytest.raises(ValueError, match=r"^document lengths: expected them to sum to the 3 "
                                         r"tokens given, found 4; "):
        builder.add_document([1, 2, 3], [2, 2])
    builder.abort()


def test_context_manager_removes_the_partial_bin_on_error(tmp_path) -> None:
    path = tmp_path / "z.bin"
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(str(path)) as builder:
        builder.add_item([1, 2, 3])
        raise RuntimeError("boom")
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no spill files left either


def test_finalize_publishes_the_bin_the_old_one_untouched_until_then(tmp_path) -> None:
    path = tmp_path / "d.bin"
    path.write_bytes(b"old")
    builder = IndexedDatasetBuilder(str(path), dtype=np.int32)
    builder.add_item([1, 2, 3])
    builder.end_document()
    assert path.read_bytes() == b"old"
    builder.finalize(str(tmp_path / "d.idx"))
    assert [x.tolist() for x in IndexedDataset(str(tmp_path / "d"))] == [[1, 2, 3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def test_leaving_the_block_without_finalize_publishes_nothing(tmp_path) -> None:
    with IndexedDatasetBuilder(str(tmp_path / "new" / "z.bin")) as builder:
        builder.add_item([1, 2, 3])
    assert [p.name for p in (tmp_path / "new").iterdir()] == []  # the directory was made


def test_a_failed_finalize_names_the_file_and_leaves_nothing(tmp_path,
                                                              serve_local_paths) -> None:
    serve_local_paths(FaultyBackend(fail_fsync=True))
    path = str(tmp_path / "z.bin")
    with pytest.raises(OSError, match=rf"injected by FaultyBackend: '{re.escape(path)}'$"), (
            IndexedDatasetBuilder(path)) as builder:
        builder.add_item([1, 2, 3])
        builder.end_document()
        builder.finalize(str(tmp_path / "z.idx"))
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_url_no_backend_serves_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"found the scheme 'hdfs'; a URL is never taken for a "
                                         r"local path$"):
        IndexedDatasetBuilder("hdfs://bucket/corpus.bin")
    assert [p.name for p in tmp_path.iterdir()] == []


def test_memory_does_not_grow_with_the_corpus(tmp_path) -> None:
    """200k sequences: the builder holds O(chunk) entries, not Python lists of all of them."""
    builder = IndexedDatasetBuilder(str(tmp_path / "big.bin"), dtype=np.uint16)
    one = np.array([7], np.uint16)
    builder.add_item(one)  # warm up the buffers
    tracemalloc.start()
    for _ in range(200_000):
        builder.add_item(one)
        builder.end_document()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    builder.finalize(str(tmp_path / "big.idx"))
    assert peak < 2 << 20, peak  # megatron's lists would hold ~200k ints + ~200k ints
    ds = IndexedDataset(str(tmp_path / "big"))
    assert len(ds) == 200_001 and ds.num_documents == 200_000
    assert int(ds.sequence_pointers[-1]) == 200_000 * 2


def test_add_index_writes_what_megatron_writes(tmp_path, megatron) -> None:
    parts = [[np.arange(5), np.arange(2)], [np.arange(9)]]
    for k, documents in enumerate(parts):
        write_indexed_dataset(str(tmp_path / f"p{k}"), documents, dtype=np.int32)
    ours = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype=np.int32)
    theirs = megatron.indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"),
                                                            dtype=np.int32)
    for builder in (ours, theirs):
        builder.add_item(torch.tensor([1, 2, 3]))
        builder.end_document()
        for k in range(len(parts)):
            builder.add_index(str(tmp_path / f"p{k}"))
        builder.add_document([4, 5], [1, 1])
    ours.finalize(str(tmp_path / "ours.idx"))
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (
            tmp_path / f"theirs{suffix}").read_bytes()
