"""fake-gcs-server, the test GCS server: it starts, serves its bucket over the JSON API, stops."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest

from tests.conftest import skip_without_fake_gcs


def _call(method: str, url: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request; an HTTP error status is returned, not raised."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def _multipart_upload(server: Any, key: str, data: bytes, metadata: dict[str, str],
                      query: str = "") -> tuple[int, bytes]:
    boundary = "asynctron-boundary"
    body = b"".join([
        f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
        json.dumps({"name": key, "metadata": metadata}).encode(),
        f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
        data, f"\r\n--{boundary}--\r\n".encode()])
    status, _, answer = _call(
        "POST", f"{server.endpoint}/upload/storage/v1/b/{server.bucket}/o"
        f"?uploadType=multipart{query}", body,
        {"Content-Type": f"multipart/related; boundary={boundary}"})
    return status, answer


def test_upload_and_ranged_download(fake_gcs_server: Any) -> None:
    server = fake_gcs_server
    key = "test_fake_gcs/upload and range"
    data = os.urandom(3 << 20)
    status, answer = _multipart_upload(server, key, data, {"asynctron-save": "x"},
                                       "&ifGenerationMatch=0")
    assert status == 200, answer
    generation = json.loads(answer)["generation"]
    # the create-only-if-absent a GCS backend relies on: multipart uploads honour it
    status, answer = _multipart_upload(server, key, b"again", {}, "&ifGenerationMatch=0")
    assert status == 412, answer

    object_url = (f"{server.endpoint}/storage/v1/b/{server.bucket}/o/"
                  f"{urllib.parse.quote(key, safe='')}")
    status, headers, answer = _call("GET", object_url)
    assert status == 200, answer
    found = json.loads(answer)
    assert (found["size"], found["generation"], found["metadata"]) == (
        str(len(data)), generation, {"asynctron-save": "x"})
    assert "Date" in headers

    first, last = (1 << 20) - 10, (2 << 20) + 9
    status, headers, answer = _call("GET", object_url + "?alt=media",
                                    headers={"Range": f"bytes={first}-{last}"})
    assert status == 206
    assert headers["Content-Range"] == f"bytes {first}-{last}/{len(data)}"
    assert answer == data[first:last + 1]

    assert _call("DELETE", object_url)[0] == 200
    assert _call("GET", object_url)[0] == 404


def test_start_and_stop(tmp_path: Any) -> None:
    """A server of its own (besides the session's) creates its bucket, logs in its data
    directory and, once stopped, has exited and no longer answers."""
    skip_without_fake_gcs()
    from asynctron.testing.fake_gcs import FakeGcs

    with FakeGcs.start(str(tmp_path), bucket="other") as server:
        assert server.environment() == {"STORAGE_EMULATOR_HOST": server.endpoint}
        status, _, answer = _call("GET", server.endpoint + "/storage/v1/b")
        assert status == 200
        assert [b["name"] for b in json.loads(answer)["items"]] == ["other"]
    assert server.process.returncode is not None
    assert os.path.getsize(server.log_path) > 0
    assert os.path.dirname(server.log_path) == str(tmp_path)
    with pytest.raises(OSError):
        urllib.request.urlopen(server.endpoint + "/_internal/healthcheck", timeout=1)
    server.stop()  # again: nothing
