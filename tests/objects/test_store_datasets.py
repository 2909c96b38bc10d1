"""Datasets on each real object store: the same samples as the corpus read locally; the
`.idx` cached once and fetched again when its copy is
damaged; the `.bin` read through a budgeted block cache shared by processes; builders that
publish to the store only when complete."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
from typing import Any

import numpy as np
import pytest

from asynctron import Engine
from asynctron.datasets import (
    AsyncLoader,
    GPTDatasetConfig,
    IndexedDataset,
    IndexedDatasetBuilder,
    ObjectStorageConfig,
    build_gpt_datasets,
    object_cache_usage,
)
from asynctron.datasets.formats._builder import write_indexed_dataset
from asynctron.datasets.object_cache._object_storage import cache_path
from tests.datasets.conftest import Tok, random_documents
from tests.objects.conftest import Store, upload_dataset

MiB = 1 << 20


def _config(tmp_path: Any, **fields: Any) -> ObjectStorageConfig:
    return ObjectStorageConfig(str(tmp_path / "cache"), **fields)


def test_samples_equal_the_local_corpus_and_the_idx_is_cached_once(
        corpus: tuple[IndexedDataset, str], tmp_path: Any) -> None:
    local, url = corpus
    config = _config(tmp_path)
    ds = IndexedDataset(url, mmap=False, object_storage_config=config)
    assert (len(ds), ds.num_documents, ds.dtype) == (len(local), local.num_documents,
                                                    local.dtype)
    order = np.random.default_rng(0).permutation(len(ds))[:300]
    for i in order.tolist():
        assert np.array_equal(ds[i], local[i])
    assert all(np.array_equal(a, b) for a, b in zip(ds[10:40], local[10:40], strict=True))
    assert np.array_equal(ds.get(7, 3, 20), local.get(7, 3, 20))
    idx = cache_path(url + ".idx", config.path_to_idx_cache)
    with open(idx, "rb") as f, open(local.idx_path, "rb") as g:
        assert f.read() == g.read()
    usage = object_cache_usage(config.path_to_idx_cache)
    assert 0 < usage.bytes_cached <= usage.bytes_fetched
    assert usage.bytes_fetched < 0.8 * os.path.getsize(local.bin_path)  # no whole download


def test_a_damaged_cached_idx_is_fetched_again(corpus: tuple[IndexedDataset, str],
                                               tmp_path: Any) -> None:
    local, url = corpus
    config = _config(tmp_path)
    IndexedDataset(url, mmap=False, object_storage_config=config)
    idx = cache_path(url + ".idx", config.path_to_idx_cache)
    size = os.path.getsize(idx)
    for damage in ("flip", "truncate", "remove"):
        if damage == "flip":
            with open(idx, "r+b") as f:
                f.seek(size // 2)
                byte = f.read(1)
                f.seek(size // 2)
                f.write(bytes([byte[0] ^ 0xFF]))
        elif damage == "truncate":
            os.truncate(idx, size - 100)
        else:
            os.unlink(idx)
        ds = IndexedDataset(url, mmap=False, object_storage_config=config)
        assert np.array_equal(ds[5], local[5])
        with open(idx, "rb") as f, open(local.idx_path, "rb") as g:
            assert f.read() == g.read(), damage


def test_a_replaced_object_is_read_at_its_new_version(
        corpus: tuple[IndexedDataset, str], tmp_path: Any, store: Store) -> None:
    if store.scheme == "gs":
        pytest.skip("fake-gcs-server ignores ifGenerationMatch on reads (tried 2026-11-28): "
                    "reading one generation of a replaced object is untested on GCS")
    _, url = corpus
    config = _config(tmp_path)
    first = IndexedDataset(url, mmap=False, object_storage_config=config)
    for i in range(20):
        first[i]
    other = write_indexed_dataset(str(tmp_path / "other" / "c"),
                                  random_documents(9, 500, max_length=900, eod=0),
                                  dtype=np.uint16)
    upload_dataset(store, other.path_prefix, url)
    with pytest.raises(Exception, match=r"replaced since it was opened"):
        first[len(first) - 1]  # an uncached block of the old version
    again = IndexedDataset(url, mmap=False, object_storage_config=config)
    assert len(again) == len(other)
    for i in range(0, len(other), 37):
        assert np.array_equal(again[i], other[i])


def test_the_cache_stays_within_its_budget_and_reads_stay_right(
        tmp_path: Any, store: Store) -> None:
    local = write_indexed_dataset(str(tmp_path / "local" / "big"),
                                  random_documents(4, 6000, max_length=6000, eod=0),
                                  dtype=np.int32)  # ~70 MB
    url = f"{store.root}/big"
    upload_dataset(store, local.path_prefix, url)
    config = _config(tmp_path, cache_budget_bytes=16 * MiB)
    ds = IndexedDataset(url, mmap=False, object_storage_config=config)
    rng = np.random.default_rng(1)
    most = 0
    for i in rng.permutation(len(ds))[:1500].tolist():
        assert np.array_equal(ds[i], local[i])
        most = max(most, object_cache_usage(config.path_to_idx_cache).bytes_cached)
    assert most <= 16 * MiB + 8 * MiB  # the budget, plus at most one request in flight
    data = cache_path(url + ".bin", config.path_to_idx_cache)
    assert os.stat(data).st_blocks * 512 <= 16 * MiB + 8 * MiB + 64 * 4096  # holes punched


async def _batches(dataset: Any, count: int) -> list[dict[str, Any]]:
    async with Engine(num_workers=1) as engine, AsyncLoader(
            dataset, micro_batch_size=4, run_blocking=engine.run_blocking,
            prefetch_budget=1 << 20, num_ready_batches=2, num_workers=2) as loader:
        batches = []
        async for batch in loader:
            batches.append({key: value.clone() for key, value in batch.items()})
            if len(batches) == count:
                break
        return batches


def test_gpt_samples_through_the_loader_equal_the_local_ones(
        corpus: tuple[IndexedDataset, str], tmp_path: Any) -> None:
    local, url = corpus

    def gpt(path: str, cache: str) -> Any:
        config = GPTDatasetConfig(random_seed=5, sequence_length=64, tokenizer=Tok(),
                                  blend=([path], None), split="1", mmap_bin_files=False,
                                  object_storage_cache_path=str(tmp_path / "objects"),
                                  path_to_cache=cache)
        return build_gpt_datasets(config, [None, None, None])[0]

    ours = gpt(url, None)  # the GPT indices go to the object cache directory
    theirs = gpt(local.path_prefix, str(tmp_path / "local-cache"))
    assert len(ours) == len(theirs)
    for i in (0, 1, len(ours) // 2, len(ours) - 1):
        assert all(np.array_equal(ours[i][k], theirs[i][k]) for k in theirs[i])
    assert os.path.isdir(os.path.join(cache_path(url, str(tmp_path / "objects")), "cache"))
    before = object_cache_usage(str(tmp_path / "objects")).requests
    ours_batches = asyncio.run(_batches(ours, 30))
    local_batches = asyncio.run(_batches(theirs, 30))
    for a, b in zip(ours_batches, local_batches, strict=True):
        assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in b)
    assert object_cache_usage(str(tmp_path / "objects")).requests > before


def _read_all(url: str, cache: str, seed: int, start: Any, results: Any) -> None:
    ds = IndexedDataset(url, mmap=False, object_storage_config=ObjectStorageConfig(
        cache, cache_budget_bytes=16 * MiB))
    start.wait()  # every process reads the cold corpus at once
    total = 0
    for i in np.random.default_rng(seed).permutation(len(ds)).tolist():
        total += int(ds[i].astype(np.int64).sum())
    results.put(total)


@pytest.mark.slow
def test_processes_sharing_one_cache_read_right_and_fetch_each_block_once(
        corpus: tuple[IndexedDataset, str], tmp_path: Any) -> None:
    local, url = corpus
    expected = sum(int(local[i].astype(np.int64).sum()) for i in range(len(local)))
    cache = str(tmp_path / "shared")
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(4), context.Queue()
    readers = [context.Process(target=_read_all, args=(url, cache, seed, start, results))
               for seed in range(4)]
    for reader in readers:
        reader.start()
    totals = [results.get(timeout=240) for _ in readers]
    for reader in readers:
        reader.join(timeout=60)
    assert totals == [expected] * 4
    usage = object_cache_usage(cache)
    assert usage.bytes_fetched == os.path.getsize(local.bin_path)  # every block once


def test_a_builder_publishes_both_files_only_when_complete(
        tmp_path: Any, store: Store) -> None:
    documents = random_documents(5, 3000, max_length=3000, eod=0)  # ~18 MB: multipart
    with IndexedDatasetBuilder(f"{store.root}/built.bin", dtype=np.uint16) as builder:
        for tokens in documents:
            builder.add_item(tokens)
            builder.end_document()
        assert store.keys_under(store.root) == []  # parts, but no object yet
        builder.finalize(f"{store.root}/built.idx")
    assert store.keys_under(store.root) == ["built.bin", "built.idx"]
    assert store.uploads_under(store.root) == []
    ds = IndexedDataset(f"{store.root}/built", mmap=False,
                        object_storage_config=_config(tmp_path))
    for i in (0, 1, 1500, 2999):
        assert np.array_equal(ds[i], documents[i])

    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetBuilder(
            f"{store.root}/failed.bin", dtype=np.uint16) as builder:
        for tokens in documents:
            builder.add_item(tokens)
            builder.end_document()
        raise RuntimeError("boom")
    assert store.keys_under(store.root) == ["built.bin", "built.idx"]
    assert store.uploads_under(store.root) == []


def test_missing_objects_and_bad_paths_are_named(tmp_path: Any, store: Store) -> None:
    config = _config(tmp_path)
    prefix = store.root.split("://")[1].partition("/")[2]
    with pytest.raises(FileNotFoundError, match=rf"{prefix}/absent\.idx.*{store.endpoint}"):
        IndexedDataset(f"{store.root}/absent", mmap=False, object_storage_config=config)
    with pytest.raises(FileNotFoundError, match=r"'no-such-bucket' does not exist"):
        IndexedDataset(f"{store.scheme}://no-such-bucket/x", mmap=False,
                       object_storage_config=config)
    with pytest.raises(ValueError, match=r"mmap=False"):
        IndexedDataset(f"{store.root}/x", mmap=True, object_storage_config=config)
    with pytest.raises(ValueError, match=r"object_storage_config=ObjectStorageConfig"):
        IndexedDataset(f"{store.root}/x", mmap=False)
    with pytest.raises(ValueError, match=r"block_bytes"):
        ObjectStorageConfig(str(tmp_path), block_bytes=5000)


def test_preprocess_writes_to_the_store(tmp_path: Any, store: Store) -> None:
    from asynctron.cli import main

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i} " + "x" * (i % 50)}) + "\n"
                             for i in range(400)))
    common = ["--input", str(jsonl), "--tokenizer", "byte", "--append-eod"]
    assert main(["preprocess", *common, "--output-prefix", str(tmp_path / "local")]) == 0
    assert main(["preprocess", *common, "--output-prefix", f"{store.root}/out"]) == 0
    assert store.keys_under(store.root) == ["out_text_document.bin", "out_text_document.idx"]
    local = IndexedDataset(str(tmp_path / "local_text_document"))
    ours = IndexedDataset(f"{store.root}/out_text_document", mmap=False,
                          object_storage_config=_config(tmp_path))
    assert len(ours) == len(local) == 400
    assert all(np.array_equal(ours[i], local[i]) for i in range(len(local)))


def test_gpt_indices_published_to_the_store_are_built_once(
        corpus: tuple[IndexedDataset, str], tmp_path: Any, store: Store) -> None:
    from asynctron.datasets.formats._cache import observing

    _, url = corpus
    config = GPTDatasetConfig(random_seed=5, sequence_length=64, tokenizer=Tok(),
                              blend=([url], None), split="1", mmap_bin_files=False,
                              object_storage_cache_path=str(tmp_path / "objects"),
                              path_to_cache=f"{store.root}/indices")
    uses: list[Any] = []
    with observing(uses.append):
        first = build_gpt_datasets(config, [None, None, None])[0]
        again = build_gpt_datasets(config, [None, None, None])[0]  # another node, say
    assert [use.built for use in uses] == [True, False]
    names = store.keys_under(store.root)
    assert sum(name.startswith("indices/") and name.endswith(".npy") for name in names) == 3
    assert np.array_equal(first.shuffle_index, again.shuffle_index)
    assert all(np.array_equal(first[i]["tokens"], again[i]["tokens"]) for i in (0, 5, 9))
