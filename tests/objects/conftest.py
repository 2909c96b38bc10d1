"""The object-store suite's fixture: `store`, one real server per cloud (SeaweedFS for S3,
Azurite for Azure Blob, fake-gcs-server for GCS), started once per session; every test here
runs once per store. Each test gets its own prefix (`store.root`), the store's standard
settings in its environment (so `backend_for` finds the server), and a plain client (the
cloud's own SDK; for GCS, its JSON API over urllib) to look at the bucket as a user would.
Nothing patches a client."""

from __future__ import annotations

import json
import os
import re
import secrets
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from asynctron.storage.backends import Backend


@dataclass
class Store:
    """One store under test: `root` is this test's own prefix in its bucket."""

    scheme: str
    root: str
    endpoint: str
    server: Any
    raw: Any
    """The cloud SDK's own (synchronous) client."""

    def backend(self, endpoint: str | None = None, **config: Any) -> Backend:
        """A backend of this store configured in code: through `endpoint` (a proxy's) if
        given, with `config`'s settings."""
        if self.scheme == "gs":
            from asynctron.storage.backends.gcs import GcsBackend, GcsConfig

            return GcsBackend(GcsConfig(endpoint_url=endpoint or self.endpoint, **config))
        if self.scheme == "s3":
            from asynctron.storage.backends.s3 import S3Backend, S3Config

            env = self.server.environment()
            return S3Backend(S3Config(endpoint_url=endpoint or self.endpoint,
                                      access_key_id=env["AWS_ACCESS_KEY_ID"],
                                      secret_access_key=env["AWS_SECRET_ACCESS_KEY"], **config))
        from asynctron.storage.backends.azure import AzureBackend, AzureConfig
        from asynctron.testing.azurite import ACCOUNT_KEY, ACCOUNT_NAME

        url = (endpoint or self.server.endpoint.rsplit("/", 1)[0]) + f"/{ACCOUNT_NAME}"
        return AzureBackend(AzureConfig(account_url=url, account_name=ACCOUNT_NAME,
                                        account_key=ACCOUNT_KEY, **config))

    def _split(self, url: str) -> tuple[str, str]:
        bucket, _, key = url.split("://", 1)[1].partition("/")
        return bucket, key

    def keys_under(self, root: str) -> list[str]:
        """Every object key under the URL `root` (relative to it), sorted."""
        bucket, prefix = self._split(root)
        if self.scheme == "gs":
            return sorted(name[len(prefix) + 1:] for name in self._gcs_names(bucket, prefix))
        if self.scheme == "s3":
            keys, token = [], None
            while True:
                page = self.raw.list_objects_v2(Bucket=bucket, Prefix=prefix + "/", **(
                    {"ContinuationToken": token} if token else {}))
                keys += [entry["Key"][len(prefix) + 1:] for entry in page.get("Contents", ())]
                token = page.get("NextContinuationToken")
                if not token:
                    return sorted(keys)
        container = self.raw.get_container_client(bucket)
        return sorted(blob.name[len(prefix) + 1:]
                      for blob in container.list_blobs(name_starts_with=prefix + "/"))

    def uploads_under(self, root: str) -> list[str]:
        """The keys of the uploads in parts still open under the URL `root` (S3's multipart
        uploads; Azure's blobs with staged blocks only)."""
        bucket, prefix = self._split(root)
        if self.scheme == "gs":
            return sorted({name.partition(".asynctron-part-")[0]
                           for name in self._gcs_names(bucket, prefix)
                           if ".asynctron-part-" in name})
        if self.scheme == "s3":
            page = self.raw.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/")
            return sorted(upload["Key"] for upload in page.get("Uploads", ()))
        container = self.raw.get_container_client(bucket)
        committed = {blob.name for blob in container.list_blobs(name_starts_with=prefix + "/")}
        return sorted(blob.name for blob in container.list_blobs(
            name_starts_with=prefix + "/", include=["uncommittedblobs"])
            if blob.name not in committed)

    def _gcs(self, method: str, path: str, data: bytes | None = None) -> bytes:
        request = urllib.request.Request(f"{self.endpoint}{path}", data=data, method=method)
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.read()

    def _gcs_names(self, bucket: str, prefix: str) -> list[str]:
        names, token = [], ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix + "/", "pageToken": token})
            page = json.loads(self._gcs("GET", f"/storage/v1/b/{bucket}/o?{query}"))
            names += [item["name"] for item in page.get("items", ())]
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def get(self, url: str) -> bytes:
        bucket, key = self._split(url)
        if self.scheme == "gs":
            return self._gcs("GET", f"/storage/v1/b/{bucket}/o/{_quoted(key)}?alt=media")
        if self.scheme == "s3":
            return self.raw.get_object(Bucket=bucket, Key=key)["Body"].read()
        return self.raw.get_blob_client(bucket, key).download_blob().readall()

    def delete(self, url: str) -> None:
        bucket, key = self._split(url)
        if self.scheme == "gs":
            self._gcs("DELETE", f"/storage/v1/b/{bucket}/o/{_quoted(key)}")
        elif self.scheme == "s3":
            self.raw.delete_object(Bucket=bucket, Key=key)
        else:
            self.raw.get_blob_client(bucket, key).delete_blob()

    def put(self, url: str, data: bytes) -> None:
        bucket, key = self._split(url)
        if self.scheme == "gs":
            query = urllib.parse.urlencode({"uploadType": "media", "name": key})
            self._gcs("POST", f"/upload/storage/v1/b/{bucket}/o?{query}", data)
        elif self.scheme == "s3":
            self.raw.put_object(Bucket=bucket, Key=key, Body=data)
        else:
            self.raw.get_blob_client(bucket, key).upload_blob(data, overwrite=True)


@pytest.fixture(params=["s3", "azure", "gcs"])
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """Each test once per store, with its own prefix and the store's settings in the env."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:50]
    prefix = f"{name}-{secrets.token_hex(3)}"
    if request.param == "s3":
        pytest.importorskip("aiobotocore", reason="the s3 extra (aiobotocore) is not installed")
        server = request.getfixturevalue("s3_env")
        import botocore.session
        from botocore.config import Config

        env = server.environment()
        raw = botocore.session.get_session().create_client(
            "s3", endpoint_url=server.endpoint, region_name="us-east-1",
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}))
        yield Store("s3", f"s3://{server.bucket}/{prefix}", server.endpoint, server, raw)
        return
    if request.param == "gcs":
        server = request.getfixturevalue("fake_gcs_server")
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        for variable, value in server.environment().items():
            monkeypatch.setenv(variable, value)
        yield Store("gs", f"gs://{server.bucket}/{prefix}", server.endpoint, server, None)
        return
    server = request.getfixturevalue("azurite_server")
    from azure.storage.blob import BlobServiceClient

    for variable in list(os.environ):
        if variable.startswith("AZURE_STORAGE_"):
            monkeypatch.delenv(variable)
    for variable, value in server.environment().items():
        monkeypatch.setenv(variable, value)
    raw = BlobServiceClient.from_connection_string(server.connection_string)
    yield Store("az", f"az://{server.container}/{prefix}", server.endpoint, server, raw)
    raw.close()


def upload_dataset(store: Store, local_prefix: str, url_prefix: str) -> None:
    """Put the `.bin` and `.idx` at `local_prefix` under `url_prefix`, as a user's tool would."""
    for suffix in (".bin", ".idx"):
        with open(local_prefix + suffix, "rb") as f:
            store.put(url_prefix + suffix, f.read())


@pytest.fixture
def corpus(tmp_path: Any, store: Store) -> tuple[Any, str]:
    """A ~3 MB token corpus written locally (the `IndexedDataset`), and the same files
    uploaded under store.root (the URL prefix)."""
    import numpy as np

    from asynctron.datasets.formats._builder import write_indexed_dataset
    from tests.datasets.conftest import random_documents

    local = write_indexed_dataset(str(tmp_path / "local" / "c"),
                                  random_documents(3, 2000, max_length=1500, eod=0),
                                  dtype=np.uint16)
    upload_dataset(store, local.path_prefix, f"{store.root}/c")
    return local, f"{store.root}/c"


@pytest.fixture
def proxy(store: Store) -> Iterator[Any]:
    """A TCP proxy in front of the store's server, to cut, reset or stall its connections."""
    from asynctron.testing.tcp_proxy import TcpFaultProxy

    host, _, port = store.endpoint.split("://", 1)[1].split("/", 1)[0].partition(":")
    with TcpFaultProxy.start(host, int(port)) as proxy:
        yield proxy


def _quoted(key: str) -> str:
    return urllib.parse.quote(key, safe="")
