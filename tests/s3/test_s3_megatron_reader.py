"""megatron-core's own S3 reader (boto3) and ours read the same samples from one bucket."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from asynctron.datasets import IndexedDataset
from asynctron.testing.seaweedfs import SeaweedFS


def test_megatron_cores_own_s3_reader_reads_the_same_samples(
        corpus: tuple[IndexedDataset, str], tmp_path: Any, s3_env: SeaweedFS) -> None:
    pytest.importorskip("boto3", reason="megatron-core's S3 reader needs boto3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset as megatron
    _, url = corpus  # boto3 finds the server in the environment (AWS_ENDPOINT_URL)
    theirs = megatron.IndexedDataset(url, multimodal=False, mmap=False,
                                     object_storage_config=megatron.ObjectStorageConfig(
                                         path_to_idx_cache=str(tmp_path / "theirs")))
    ours = IndexedDataset(url, mmap=False, object_storage_config=megatron.ObjectStorageConfig(
        path_to_idx_cache=str(tmp_path / "ours")))  # megatron's config object, accepted
    assert len(ours) == len(theirs)
    for i in np.random.default_rng(2).permutation(len(ours))[:200].tolist():
        assert np.array_equal(ours[i], theirs[i])


