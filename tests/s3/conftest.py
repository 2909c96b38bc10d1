"""The object-storage tests' fixtures: each test gets its own prefix in the one bucket of the
session's real S3-compatible server (`s3_server`, `s3_env` in tests/conftest.py, shared with
Megatron-LM's reader test). Nothing patches the client."""

from __future__ import annotations

import re
import secrets
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiobotocore", reason="the s3 extra (aiobotocore) is not installed")

from asynctron.testing.seaweedfs import SeaweedFS


@pytest.fixture
def s3_root(s3_env: SeaweedFS, request: pytest.FixtureRequest) -> str:
    """`s3://bucket/<this test's own prefix>`."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:60]
    return f"s3://{s3_env.bucket}/{name}-{secrets.token_hex(3)}"


@pytest.fixture
def s3_objects(s3_env: SeaweedFS) -> Any:
    """A plain botocore client of the test server, to look at the bucket as a user would."""
    import botocore.session
    from botocore.config import Config

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=s3_env.endpoint, region_name="us-east-1",
        aws_access_key_id=s3_env.environment()["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3_env.environment()["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}))


def keys_under(client: Any, root: str) -> list[str]:
    """Every object key under the URL `root` (relative to it), sorted."""
    bucket, _, prefix = root[5:].partition("/")
    keys, token = [], None
    while True:
        page = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/",
                                      **({"ContinuationToken": token} if token else {}))
        keys += [entry["Key"][len(prefix) + 1:] for entry in page.get("Contents", ())]
        token = page.get("NextContinuationToken")
        if not token:
            return sorted(keys)


def uploads_under(client: Any, root: str) -> list[str]:
    """The keys of the multipart uploads still open under the URL `root`."""
    bucket, _, prefix = root[5:].partition("/")
    page = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/")
    return sorted(upload["Key"] for upload in page.get("Uploads", ()))


def upload_dataset(objects: Any, local_prefix: str, url_prefix: str) -> None:
    """Put the `.bin` and `.idx` at `local_prefix` under `url_prefix`, as a user's tool would."""
    bucket, _, key = url_prefix[5:].partition("/")
    for suffix in (".bin", ".idx"):
        with open(local_prefix + suffix, "rb") as f:
            objects.put_object(Bucket=bucket, Key=key + suffix, Body=f.read())


@pytest.fixture
def corpus(tmp_path: Any, s3_root: str, s3_objects: Any) -> tuple[Any, str]:
    """A ~3 MB token corpus written locally (the `IndexedDataset`), and the same files
    uploaded under s3_root (the URL prefix)."""
    from asynctron.datasets.formats._builder import write_indexed_dataset
    from tests.datasets.conftest import random_documents

    local = write_indexed_dataset(str(tmp_path / "local" / "c"),
                                  random_documents(3, 2000, max_length=1500, eod=0),
                                  dtype=np.uint16)
    upload_dataset(s3_objects, local.path_prefix, f"{s3_root}/c")
    return local, f"{s3_root}/c"
