"""IndexedDataset: reading megatron's .bin/.idx byte for byte, and clear errors for bad files."""

from __future__ import annotations

import os
import pickle
import re
import struct

import numpy as np
import pytest

from asynctron.datasets import (
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_gpt_datasets,
)
from asynctron.datasets.formats import _indexed as indexed_module
from asynctron.datasets.formats._builder import write_indexed_dataset
from asynctron.datasets.formats._indexed import DTYPE_CODES, optimal_dtype, read_index_header
from asynctron.errors import CorruptDatasetError


@pytest.mark.parametrize("dtype", sorted({d.name for d in DTYPE_CODES.values()}))
def test_round_trip_every_dtype(tmp_path, dtype: str) -> None:
    documents = [np.arange(n, dtype=dtype) for n in (5, 1, 17, 3)]
    ds = write_indexed_dataset(str(tmp_path / "d"), documents, dtype=dtype)
    assert len(ds) == 4 and ds.num_documents == 4 and ds.dtype == np.dtype(dtype)
    for i, document in enumerate(documents):
        assert ds[i].dtype == np.dtype(dtype)
        assert np.array_equal(ds[i], document)
    assert ds.sequence_lengths.tolist() == [5, 1, 17, 3]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    itemsize = np.dtype(dtype).itemsize
    assert ds.sequence_pointers.tolist() == [0, 5 * itemsize, 6 * itemsize, 23 * itemsize]


def test_slices_and_get(make_corpus) -> None:
    ds = make_corpus("c", num_documents=20)
    parts = ds[3:7]
    assert len(parts) == 4
    for k, part in enumerate(parts):
        assert np.array_equal(part, ds[3 + k])
    assert ds[5:5] == []
    whole = ds[7]
    assert np.array_equal(ds.get(7, offset=2, length=3), whole[2:5])
    assert np.array_equal(ds.get(7, offset=1), whole[1:])
    assert ds.byte_range(7, 2, 3) == (int(ds.sequence_pointers[7]) + 4, 6)
    with pytest.raises(ValueError, match=r"^slice .*: expected step 1, found 2; "):
        ds[0:10:2]
    with pytest.raises(TypeError, match=r"^index 'a': expected an int or a slice, found str$"):
        ds["a"]


def test_documents_of_several_sequences(tmp_path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    builder.add_document([1, 2, 3, 4, 5], [2, 3])
    builder.add_item(np.array([6]))
    builder.add_item(np.array([7, 8]))
    builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [x.tolist() for x in ds] == [[1, 2], [3, 4, 5], [6], [7, 8]]
    assert ds.document_indices.tolist() == [0, 2, 4]


def test_multimodal_modes(tmp_path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.uint8, multimodal=True)
    builder.add_item([1, 2], mode=3)
    builder.add_document([4, 5, 6], [1, 2], modes=[1, 2])
    builder.end_document()
    builder.finalize(str(tmp_path / "mm.idx"))
    ds = IndexedDataset(str(tmp_path / "mm"), multimodal=True)
    tokens, mode = ds[0]
    assert tokens.tolist() == [1, 2] and mode == 3
    parts, modes = ds[1:3]
    assert [p.tolist() for p in parts] == [[4], [5, 6]] and modes.tolist() == [1, 2]
    plain = IndexedDataset(str(tmp_path / "mm"))  # the modes are there but not asked for
    assert plain[0].tolist() == [1, 2]
    write_indexed_dataset(str(tmp_path / "plain"), [[1]], dtype=np.uint8)
    with pytest.raises(CorruptDatasetError, match=r"expected sequence modes .* for a multimodal"):
        IndexedDataset(str(tmp_path / "plain"), multimodal=True)


def test_empty_dataset(tmp_path) -> None:
    builder = IndexedDatasetBuilder(str(tmp_path / "e.bin"))
    builder.finalize(str(tmp_path / "e.idx"))
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_documents == 0 and list(ds) == []


def test_pickle_reopens(make_corpus) -> None:
    ds = make_corpus("p", num_documents=5)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.path_prefix == ds.path_prefix
    assert all(np.array_equal(copy[i], ds[i]) for i in range(len(ds)))


def test_optimal_dtype_is_megatrons_rule() -> None:
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


# corrupt files -------------------------------------------------------------------------------

@pytest.fixture
def good(make_corpus):
    ds = make_corpus("g", num_documents=10)
    return ds.path_prefix


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_files_name_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"dataset .*nowhere: expected .*nowhere\.idx, "
                                                r"found no such file; check the path prefix"):
        IndexedDataset(str(tmp_path / "nowhere"))
    assert not IndexedDataset.exists(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_missing_bin_names_the_path(good: str, use_mmap: bool) -> None:
    os.remove(good + ".bin")
    with pytest.raises(FileNotFoundError, match=rf"^dataset {re.escape(good)}: expected "
                                                rf"{re.escape(good)}\.bin, found no such file; "
                                                r"check the path prefix \(without \.bin/\.idx\)$"):
        IndexedDataset(good, mmap=use_mmap)
    assert not IndexedDataset.exists(good)


def test_a_url_no_backend_serves_is_refused_not_taken_for_a_local_path() -> None:
    for call in (IndexedDataset, IndexedDataset.exists):
        with pytest.raises(ValueError, match=r"found the scheme 'hdfs'; a URL is never taken for "
                                             r"a local path$"):
            call("hdfs://bucket/corpus_text_document")
        with pytest.raises(ValueError, match=r"did you mean 'gs://bucket/corpus_text_document"):
            call("gs//bucket/corpus_text_document")


def test_wrong_magic(good: str) -> None:
    _patch(good + ".idx", 0, b"NOTANIDX!")
    with pytest.raises(CorruptDatasetError, match=re.escape(
            f"index {good}.idx: expected magic b'MMIDIDX\\x00\\x00', found b'NOTANIDX!'; this "
            "is not a megatron .idx file")) as info:
        IndexedDataset(good)
    assert info.value.path == good + ".idx" and info.value.offset == 0


def test_wrong_version(good: str) -> None:
    _patch(good + ".idx", 9, struct.pack("<Q", 2))
    with pytest.raises(CorruptDatasetError, match=r"expected version 1, found 2; this \.idx "
                                                  r"format is not supported$"):
        IndexedDataset(good)


def test_unknown_dtype_code(good: str) -> None:
    _patch(good + ".idx", 17, bytes([9]))
    with pytest.raises(CorruptDatasetError, match=r"expected a dtype code in \[1, 2, 3, 4, 5, 6, "
                                                  r"7, 8\], found 9; the file is corrupt$"):
        IndexedDataset(good)


def test_truncated_index(good: str) -> None:
    with open(good + ".idx", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptDatasetError, match=r"expected \d+ bytes \(\d+ with sequence "
                                                  r"modes\) for 10 sequences and 11 document "
                                                  r"indices, found 100; the file is truncated"):
        IndexedDataset(good)
    with open(good + ".idx", "r+b") as f:
        f.truncate(20)
    with pytest.raises(CorruptDatasetError, match=r"expected at least 34 header bytes, found 20"):
        read_index_header(good + ".idx")


def test_trailing_bytes_in_index(good: str) -> None:
    with open(good + ".idx", "ab") as f:
        f.write(b"xyz")
    with pytest.raises(CorruptDatasetError, match=r"the file is followed by unexpected bytes"):
        IndexedDataset(good)


def _set(path: str, offset: int, fmt: str, value: int) -> None:
    _patch(path, offset, struct.pack(fmt, value))


@pytest.mark.parametrize(("entry", "value", "message"), [
    (0, 1, "document index 0: expected 0, found 1"),
    (4, 2, r"document index 4: expected >= 3 \(document index 3\), found 2"),
    (3, 99, "document index 3: expected a sequence index <= 10, found 99"),
    (10, 11, "document index 10: expected a sequence index <= 10, found 11"),
    (10, 9, r"document index 10 \(the last\): expected 10 \(the number of sequences\), found 9"),
])
def test_bad_document_indices(good: str, entry: int, value: int, message: str) -> None:
    path = good + ".idx"
    offset = read_index_header(path).document_indices_offset + 8 * entry
    _set(path, offset, "<q", value)
    with pytest.raises(CorruptDatasetError, match=rf"^index {re.escape(path)}, {message}; the "
                                                  r"file is corrupt, rebuild it$") as info:
        IndexedDataset(good)
    assert info.value.path == path and info.value.offset == offset


@pytest.fixture
def layout(good: str) -> tuple[list[int], list[int], int, int, int]:
    """`(lengths, pointers, .bin bytes, lengths offset, pointers offset)` of the good file, read
    before a test edits it."""
    ds = IndexedDataset(good)
    header = ds.header
    return (ds.sequence_lengths.tolist(), ds.sequence_pointers.tolist(),
            ds.tokens.nbytes, header.sequence_lengths_offset, header.sequence_pointers_offset)


def test_negative_length(good: str, layout) -> None:
    lengths_at = layout[3]
    _set(good + ".idx", lengths_at + 4 * 3, "<i", -3)
    with pytest.raises(CorruptDatasetError, match=re.escape(
            f"index {good}.idx, sequence 3: expected a length >= 0, found -3; the file is "
            "corrupt, rebuild it")) as info:
        IndexedDataset(good)
    assert info.value.offset == lengths_at + 4 * 3


def test_pointers_out_of_order(good: str, layout) -> None:
    lengths, pointers, _, _, pointers_at = layout
    _set(good + ".idx", pointers_at + 8 * 4, "<q", pointers[5])
    _set(good + ".idx", pointers_at + 8 * 5, "<q", pointers[4])
    with pytest.raises(CorruptDatasetError, match=re.escape(
            f"index {good}.idx, sequence 4: expected pointer {pointers[4]} (where sequence 3 "
            f"ends: pointer {pointers[3]}, length {lengths[3]}), found {pointers[5]}; the file "
            "is corrupt, rebuild it")) as info:
        IndexedDataset(good)
    assert info.value.path == good + ".idx" and info.value.offset == pointers_at + 8 * 4


@pytest.mark.parametrize("sequence", [0, 6])
def test_pointer_past_the_end_of_the_bin(good: str, layout, sequence: int) -> None:
    _, pointers, bin_bytes, _, pointers_at = layout
    _set(good + ".idx", pointers_at + 8 * sequence, "<q", bin_bytes + 100)
    after = "the start of the .bin" if sequence == 0 else "where sequence 5 ends: pointer "
    with pytest.raises(CorruptDatasetError, match=re.escape(
            f"index {good}.idx, sequence {sequence}: expected pointer {pointers[sequence]} "
            f"({after}") + rf".*, found {bin_bytes + 100}, outside the {bin_bytes}-byte "
                           rf"{re.escape(good)}\.bin; the file is corrupt"):
        IndexedDataset(good)


def test_a_length_one_too_long_is_found_at_the_next_pointer(good: str, layout) -> None:
    lengths, pointers, _, lengths_at, _ = layout
    _set(good + ".idx", lengths_at + 4 * 2, "<i", lengths[2] + 1)
    with pytest.raises(CorruptDatasetError, match=re.escape(
            f"sequence 3: expected pointer {pointers[3] + 2} (where sequence 2 ends: pointer "
            f"{pointers[2]}, length {lengths[2] + 1}), found {pointers[3]}")):
        IndexedDataset(good)


def test_a_sequence_overrunning_the_bin(good: str, layout) -> None:
    _, pointers, bin_bytes, lengths_at, _ = layout
    _set(good + ".idx", lengths_at + 4 * 2, "<i", 2**31 - 1)
    with pytest.raises(CorruptDatasetError, match=re.escape(
            f"data {good}.bin: expected at least {pointers[2] + 2 * (2**31 - 1)} bytes (sequence "
            f"2 of {good}.idx ends there: pointer {pointers[2]}, length {2**31 - 1}), found "
            f"{bin_bytes}; the .bin is truncated or belongs to another .idx")) as info:
        IndexedDataset(good)
    assert info.value.path == good + ".bin" and info.value.offset == bin_bytes


def test_truncated_bin_names_the_last_sequence(good: str, layout) -> None:
    lengths, pointers, bin_bytes, _, _ = layout
    with open(good + ".bin", "r+b") as f:
        f.truncate(bin_bytes - 2)
    with pytest.raises(CorruptDatasetError, match=re.escape(
            f"data {good}.bin: expected at least {bin_bytes} bytes (sequence 9 of {good}.idx "
            f"ends there: pointer {pointers[9]}, length {lengths[9]}), found {bin_bytes - 2}; "
            "the .bin is truncated")):
        IndexedDataset(good)


def test_bin_too_long(good: str, layout) -> None:
    bin_bytes = layout[2]
    with open(good + ".bin", "ab") as f:
        f.write(b"xy")
    with pytest.raises(CorruptDatasetError, match=re.escape(
            f"data {good}.bin: expected {bin_bytes} bytes (from {good}.idx), found "
            f"{bin_bytes + 2}; the .bin is too long or belongs to another .idx")) as info:
        IndexedDataset(good)
    assert info.value.offset == bin_bytes


def test_checks_span_steps(tmp_path, monkeypatch) -> None:
    """A fault is found in any step of the chunked checks, and named by its global index."""
    monkeypatch.setattr(indexed_module, "_CHECK_ENTRIES", 4)
    ds = write_indexed_dataset(str(tmp_path / "s"), [[1, 2], [3], [4, 5, 6]] * 5, dtype=np.int32)
    pointers_at, pointers = ds.header.sequence_pointers_offset, ds.sequence_pointers.tolist()
    assert len(IndexedDataset(ds.path_prefix)) == 15
    _set(ds.idx_path, pointers_at + 8 * 8, "<q", pointers[8] - 4)  # the first of step 3
    with pytest.raises(CorruptDatasetError, match=r"sequence 8: expected pointer 60 \(where "
                                                  r"sequence 7 ends: pointer 56, length 1\), "
                                                  r"found 56"):
        IndexedDataset(ds.path_prefix)
    _set(ds.idx_path, pointers_at + 8 * 8, "<q", pointers[8])
    _set(ds.idx_path, ds.header.document_indices_offset + 8 * 13, "<q", 11)  # step 4's first
    with pytest.raises(CorruptDatasetError, match=r"document index 13: expected >= 12"):
        IndexedDataset(ds.path_prefix)


def test_a_corrupt_pointer_fails_the_gpt_build_not_the_loader(make_corpus, tmp_path,
                                                              tok) -> None:
    """Before the whole index was checked, this file opened, and a loader's worker failed on
    the first batch reading sequence 40 (gather_tokens' ValueError, or madvise's OSError)."""
    ds = make_corpus("c", num_documents=150, eod=0)
    _set(ds.idx_path, ds.header.sequence_pointers_offset + 8 * 40, "<q", 1 << 40)
    config = GPTDatasetConfig(random_seed=5, sequence_length=32, tokenizer=tok,
                              blend=([ds.path_prefix], None), split="1",
                              path_to_cache=str(tmp_path / "cache"))
    with pytest.raises(CorruptDatasetError, match=rf"^index {re.escape(ds.idx_path)}, sequence "
                                                  rf"40: expected pointer \d+ .*, found "
                                                  rf"{1 << 40}, outside the"):
        build_gpt_datasets(config, [None, None, None])


# megatron parity: files both ways ------------------------------------------------------------

def test_megatron_reads_our_files_and_writes_the_same_bytes(tmp_path, megatron) -> None:
    documents = [np.arange(n, dtype=np.int64) % 50_000 for n in (3, 8, 1, 40, 2)]
    ours = write_indexed_dataset(str(tmp_path / "ours"), documents, dtype=np.uint16)
    theirs = megatron.indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"),
                                                            dtype=np.uint16)
    import torch

    for document in documents:
        theirs.add_item(torch.from_numpy(document))
        theirs.end_document()
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (
            tmp_path / f"theirs{suffix}").read_bytes()
    read_by_megatron = megatron.indexed_dataset.IndexedDataset(str(tmp_path / "ours"))
    for i in range(len(ours)):
        assert np.array_equal(read_by_megatron[i], ours[i])
        assert np.array_equal(read_by_megatron.get(i, 1, 1), ours.get(i, 1, 1))
    assert np.array_equal(read_by_megatron.document_indices, ours.document_indices)


def test_we_read_megatrons_multimodal_files(tmp_path, megatron) -> None:
    import torch

    builder = megatron.indexed_dataset.IndexedDatasetBuilder(
        str(tmp_path / "m.bin"), dtype=np.int32, multimodal=True)
    builder.add_item(torch.tensor([1, 2, 3]), mode=2)
    builder.add_item(torch.tensor([4]), mode=1)
    builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ours = IndexedDataset(str(tmp_path / "m"), multimodal=True)
    theirs = megatron.indexed_dataset.IndexedDataset(str(tmp_path / "m"), multimodal=True)
    for i in range(2):
        assert np.array_equal(ours[i][0], theirs[i][0]) and ours[i][1] == theirs[i][1]


def test_pread_reads_equal_mapped_reads(make_corpus) -> None:
    mapped = make_corpus("c", num_documents=50)
    read = IndexedDataset(mapped.path_prefix, mmap=False)
    assert read.tokens is None and mapped.tokens is not None
    for i in (0, 7, 49):
        assert np.array_equal(read[i], mapped[i])
        assert np.array_equal(read.get(i, 2, 5), mapped.get(i, 2, 5))
    assert all(np.array_equal(a, b) for a, b in zip(read[3:9], mapped[3:9], strict=True))
    starts = np.array([0, 11, 40], np.int64)
    counts = np.array([5, 0, 9], np.int64)
    destinations = np.array([0, 5, 5], np.int64)
    out_read, out_mapped = np.zeros(14, np.int64), np.zeros(14, np.int64)
    read.gather(starts, counts, out_read, destinations)
    mapped.gather(starts, counts, out_mapped, destinations)
    assert np.array_equal(out_read, out_mapped)
    again = pickle.loads(pickle.dumps(read))
    assert again.tokens is None and np.array_equal(again[7], mapped[7])


def test_the_index_is_megatrons_index_reader(make_corpus) -> None:
    ds = make_corpus("c", num_documents=20)
    index = ds.index
    assert (len(index), index.sequence_count, index.document_count) == (20, 20, 21)
    assert index.dtype == np.uint16 and index.dtype_size == 2
    pointer, length, mode = index[5]
    assert (pointer, length, mode) == (ds.sequence_pointers[5], ds.sequence_lengths[5], None)


def test_expected_counts_and_dtype_are_checked(make_corpus) -> None:
    ds = make_corpus("c", num_documents=20)
    IndexedDataset(ds.path_prefix, sequences_per_dataset=(20, 21), dtype_code=8)
    with pytest.raises(CorruptDatasetError, match=r"expected \(20, 22\) \(sequences, document "
                                                  r"indices\) from sequences_per_dataset, found "
                                                  r"\(20, 21\)"):
        IndexedDataset(ds.path_prefix, sequences_per_dataset=(20, 22))
    with pytest.raises(CorruptDatasetError, match=r"expected token dtype code 4, found 8 "
                                                  r"\(uint16\)"):
        IndexedDataset(ds.path_prefix, sequences_per_dataset=(20, 21), dtype_code=4)
    with pytest.raises(ValueError, match=r"object_storage_config is for s3:// paths, found a "
                                         r"local path"):
        IndexedDataset(ds.path_prefix, mmap=False, object_storage_config=object())
