"""What S3's endpoint settings get wrong, each failing at once or after a short grace and named
(a refused port, an unknown host, TLS against plain HTTP, an endpoint that is not S3), and the
CLI's deadline. The faults every store meets mid-operation are in tests/objects."""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from asynctron import Engine
from asynctron._knobs import STORE_DEADLINE_S
from asynctron.errors import StorageError
from asynctron.storage.backends.objects._requests import REFUSED_GRACE_S
from asynctron.storage.backends.s3 import S3Backend, S3Config
from asynctron.testing.seaweedfs import SeaweedFS
from asynctron.testing.tcp_proxy import TcpFaultProxy


@pytest.fixture
def proxy(s3_env: SeaweedFS) -> Iterator[TcpFaultProxy]:
    host, _, port = s3_env.endpoint.removeprefix("http://").partition(":")
    with TcpFaultProxy.start(host, int(port)) as proxy:
        yield proxy


def _unreachable(endpoint: str) -> S3Backend:
    return S3Backend(S3Config(endpoint_url=endpoint, access_key_id="k", secret_access_key="s",
                              deadline_s=60, connect_timeout_s=2))


@pytest.mark.slow
async def test_nothing_listening_at_the_endpoint_fails_after_a_short_grace(
        tmp_path: Any) -> None:
    """A typo'd port used to cost the whole deadline (60 s) per call."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    async with Engine(backend=_unreachable(f"http://127.0.0.1:{port}")) as engine:
        with pytest.raises(StorageError, match=rf"connection refused for \d\.\d s .*nothing "
                                               rf"listens at 127\.0\.0\.1:{port}; is the store up"):
            await engine.load("s3://bucket/run")
    assert time.monotonic() - started < REFUSED_GRACE_S + 5


async def test_an_unknown_host_fails_at_once() -> None:
    started = time.monotonic()
    async with Engine(backend=_unreachable("http://no-such-host.invalid:9000")) as engine:
        with pytest.raises(StorageError, match=r"the host 'no-such-host\.invalid:9000' was not "
                                               r"found .*fix the endpoint's host"):
            await engine.load("s3://bucket/run")
    assert time.monotonic() - started < 5


@pytest.fixture
def plain_http_port() -> Iterator[int]:
    """A plain HTTP server that is not S3 (every path: 404 Not Found)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


async def test_tls_against_a_plain_http_port_fails_at_once(plain_http_port: int) -> None:
    started = time.monotonic()
    async with Engine(backend=_unreachable(f"https://127.0.0.1:{plain_http_port}")) as engine:
        with pytest.raises(StorageError, match=r"TLS handshake with 127\.0\.0\.1:\d+ failed .*"
                                               r"make the endpoint URL http://"):
            await engine.load("s3://bucket/run")
    assert time.monotonic() - started < 5


async def test_an_endpoint_that_is_not_s3_is_named(plain_http_port: int) -> None:
    async with Engine(backend=_unreachable(f"http://127.0.0.1:{plain_http_port}")) as engine:
        with pytest.raises(FileNotFoundError, match=r"answered 404 without an S3 error document; "
                                                     r"is http://127\.0\.0\.1:\d+ an S3 endpoint"):
            await engine.load("s3://bucket/run")


@pytest.mark.slow
def test_the_cli_takes_the_deadline(s3_env: SeaweedFS, proxy: TcpFaultProxy,
                                    s3_root: str) -> None:
    proxy.stall()
    env = os.environ | s3_env.environment() | {"AWS_ENDPOINT_URL": proxy.endpoint,
                                               STORE_DEADLINE_S: "60"}
    done = subprocess.run([sys.executable, "-m", "asynctron", "verify", "--deadline-s", "1.5",
                           s3_root], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(r"asynctron verify: get_object \S+/latest at http://\S+: the store "
                        r"answered none of this verify's requests for 1\.5 s [^\n]*\n",
                        done.stderr), done.stderr
    proxy.pass_through()
