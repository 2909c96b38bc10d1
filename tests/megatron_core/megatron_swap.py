"""Which megatron-core names the upstream tests get from asynctron, and the rebinding itself.

Applied when conftest.py imports this, before any upstream module is collected, and around
each upstream test; restored after collection and after each test, so the parity tests in the
rest of the suite compare with megatron-core itself. `ASYNCTRON_MEGATRON_SUITE=reference`
leaves megatron-core in place (the same harness on the reference).
"""

from __future__ import annotations

import os
import warnings

import asynctron.datasets as ours
from asynctron.datasets.object_cache._range_cache import RangeCache

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core's import warns on CPU (no TE, no Apex, jit)
    import megatron.core.datasets.blended_dataset as megatron_blended
    import megatron.core.datasets.blended_megatron_dataset_builder as megatron_builder
    import megatron.core.datasets.gpt_dataset as megatron_gpt
    import megatron.core.datasets.indexed_dataset as megatron_indexed
    import megatron.core.datasets.utils as megatron_utils

REFERENCE = os.environ.get("ASYNCTRON_MEGATRON_SUITE") == "reference"


def swaps() -> dict[tuple[object, str], object]:
    """(megatron-core module, name) -> what the tests get instead."""
    return {
        (megatron_indexed, "IndexedDataset"): ours.IndexedDataset,
        (megatron_indexed, "IndexedDatasetBuilder"): ours.IndexedDatasetBuilder,
        (megatron_indexed, "_IndexReader"): ours.DatasetIndex,
        (megatron_gpt, "GPTDataset"): ours.GPTDataset,
        (megatron_gpt, "GPTDatasetConfig"): ours.GPTDatasetConfig,
        (megatron_gpt, "MockGPTDataset"): ours.MockGPTDataset,
        (megatron_blended, "BlendedDataset"): ours.BlendedDataset,
        (megatron_builder, "BlendedMegatronDatasetBuilder"): ours.BlendedMegatronDatasetBuilder,
        (megatron_utils, "Split"): ours.Split,
    }


# Compiled parts are built at install, asynctron's and the megatron-core wheel's alike (which
# ships helpers_cpp without the Makefile compile_helpers runs): there is nothing to compile.
megatron_utils.compile_helpers = lambda: None

_ORIGINALS = {key: getattr(key[0], key[1]) for key in swaps()}


def reads_with(dataset: object, kind: str) -> bool:
    """Whether `dataset` reads its `.bin` the way `kind` names ("file", "mmap", "s3", "msc"):
    through megatron-core's private reader class of that kind, or asynctron's equivalent
    (upstream's test_bin_reader asserts the class; asynctron has no reader classes)."""
    if REFERENCE:
        readers = {"file": "_FileBinReader", "mmap": "_MMapBinReader", "s3": "_S3BinReader",
                   "msc": "_MultiStorageClientBinReader"}
        return isinstance(dataset.bin_reader, getattr(megatron_indexed, readers[kind]))
    ranges = dataset._ranges
    return {"file": dataset.tokens is None and ranges is None,
            "mmap": dataset.tokens is not None,
            "s3": isinstance(ranges, RangeCache)}[kind]


def upload_dataset(server: object, prefix: str) -> str:
    """Put the local dataset `prefix` (.bin and .idx) in `server`'s bucket under its path;
    returns `bucket/key` (so `S3_PREFIX + it` is its URL). Upstream's test reads the local files
    through a stand-in boto3 client instead; here both readers meet the real server."""
    import botocore.session

    environment = server.environment()
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, region_name=environment["AWS_REGION"],
        aws_access_key_id=environment["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=environment["AWS_SECRET_ACCESS_KEY"])
    key = prefix.lstrip("/")
    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "rb") as f:
            client.put_object(Bucket=server.bucket, Key=key + suffix, Body=f.read())
    return f"{server.bucket}/{key}"


def apply() -> None:
    """Rebind each megatron-core name to asynctron's (nothing in reference mode)."""
    if not REFERENCE:
        for (module, name), replacement in swaps().items():
            setattr(module, name, replacement)


def restore() -> None:
    """Give megatron-core its own names back (for the rest of the suite's parity tests)."""
    for (module, name), original in _ORIGINALS.items():
        setattr(module, name, original)


apply()  # before the upstream modules are imported, which bind the names they import
