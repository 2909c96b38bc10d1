"""A real Azure Blob Storage server on 127.0.0.1 for tests and benchmarks: Microsoft's Azurite.

    with Azurite.start(data_dir) as server:
        os.environ.update(server.environment())     # AZURE_STORAGE_CONNECTION_STRING
        engine.save(sd, f"az://{server.container}/run/step_1")

The executable comes from npm (`make setup` installs azurite@3.37.0 into the repository's
ignored `.tools/azurite` where `npm` exists). It serves the emulator's well-known account
`devstoreaccount1` (key `ACCOUNT_KEY`), binds 127.0.0.1 only on a port picked free, sends no
telemetry, and keeps its metadata and blob bytes (its "extent" files) in `data_dir`.
`container` exists once `start` returns; give each test its own prefix in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass

from asynctron.testing._server_process import (
    ServerProcess,
    answers_http,
    find_binary,
    free_port,
)

__all__ = ["ACCOUNT_KEY", "ACCOUNT_NAME", "Azurite", "azurite_binary"]

ACCOUNT_NAME = "devstoreaccount1"
ACCOUNT_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")
"""Azurite's fixed development account and key (public: the same in every Azurite)."""
_REPO_BINARY = os.path.join(os.path.dirname(__file__), "..", "..", ".tools", "azurite",
                            "node_modules", ".bin", "azurite-blob")


def azurite_binary() -> str:
    """The `azurite-blob` executable: the repository's `.tools/azurite` (`make setup`), else
    on PATH; `node` must be on PATH too (it is a Node script).

    Raises:
        FileNotFoundError: no `azurite-blob`, or no `node` to run it.
    """
    hint = ("install it with `make setup` (needs npm), or "
            "`npm install --prefix .tools/azurite azurite@3.37.0` in the repository")
    found = find_binary("azurite-blob", _REPO_BINARY,
                        where="in the repository's .tools/azurite (Azurite's)", install=hint)
    if shutil.which("node") is None:
        raise FileNotFoundError(f"`node` (to run Azurite's {found}): not on PATH")
    return found


@dataclass
class Azurite(ServerProcess):
    """A running `azurite-blob`: the Blob API at `endpoint` (account `ACCOUNT_NAME`, key
    `ACCOUNT_KEY`), `container` created. `stop()` (or leaving the `with`) ends it and waits
    for its exit."""

    endpoint: str
    """The account's Blob URL, `http://127.0.0.1:<port>/devstoreaccount1` (path-style)."""
    container: str
    server_name = "Azurite"

    @classmethod
    def start(cls, data_dir: str, *, container: str = "asynctron-test") -> Azurite:
        """Start a server keeping its data in `data_dir` (created), wait until its Blob API
        answers, and create `container` (needs azure-storage-blob, the azure extra).

        Raises:
            FileNotFoundError: no `azurite-blob` or no `node`.
            RuntimeError: it exited or did not answer within a minute (its log is named, and
                its tail quoted).
        """
        os.makedirs(data_dir, exist_ok=True)
        port = free_port()
        log_path = os.path.join(data_dir, "azurite.log")
        # --disableTelemetry: besides sending none, Azurite then exits at once on SIGTERM
        # (with telemetry on it spends ~100 s flushing it first). --skipApiVersionCheck: the
        # SDK may speak a newer API version than this Azurite knows.
        command = [
            azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port),
            "--location", os.path.join(data_dir, "data"), "--silent", "--skipApiVersionCheck",
            "--disableTelemetry",
        ]
        return cls._launch(command, log_path, endpoint=f"http://127.0.0.1:{port}/{ACCOUNT_NAME}",
                           container=container)

    @property
    def connection_string(self) -> str:
        """The account's connection string (http, the Blob endpoint only)."""
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT_NAME};"
                f"AccountKey={ACCOUNT_KEY};BlobEndpoint={self.endpoint};")

    def environment(self) -> dict[str, str]:
        """The variables that point an Azure Blob client at this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def _answers(self) -> bool:
        return answers_http(self.endpoint + "?comp=list")  # the Blob API (403 unsigned)

    def _set_up(self) -> None:
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        with (BlobServiceClient.from_connection_string(self.connection_string,
                                                       retry_total=0) as client,
              contextlib.suppress(ResourceExistsError)):
            client.create_container(self.container)
