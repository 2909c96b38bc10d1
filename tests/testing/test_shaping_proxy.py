"""ShapingProxy in front of a real HTTP/1.1 server: bandwidth, first-byte delay and the
in-flight limit each hold, per request on keep-alive connections, and the counters add up.

Times are checked as lower bounds only (the machine is shared and noisy)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import io
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from asynctron.testing import ShapingProxy, StoreProfile

_TIMEOUT_S = 10.0
_SLOWDOWN_CODE = b"<Code>SlowDown</Code>"


class _Server(http.server.ThreadingHTTPServer):
    """`GET /bytes/N`: N bytes; `GET /chunked/N`: N bytes in chunks; `GET /hold`: answers once
    `release` is set (each arrival put on `held`); PUT and POST: reads the body (length or
    chunked), answers 200 with no body; HEAD: a head saying 3 bytes."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.held: queue.Queue[str] = queue.Queue()
        self.release = threading.Event()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, body: bytes, *, chunked: bool = False) -> None:
        self.send_response(200)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(body), 1000):
                part = body[start:start + 1000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        kind, _, size = self.path.strip("/").partition("/")
        if kind == "hold":
            self.server.held.put(self.path)
            self.server.release.wait(_TIMEOUT_S)
        self._reply(b"x" * int(size or 2), chunked=kind == "chunked")

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()

    def do_PUT(self) -> None:
        if self.headers.get("Transfer-Encoding") == "chunked":
            while size := int(self.rfile.readline().split(b";")[0], 16):
                self.rfile.read(size + 2)
            self.rfile.readline()
        else:
            self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(b"")

    do_POST = do_PUT


@pytest.fixture
def server() -> Iterator[_Server]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join()


def _proxy(server: _Server, spec: str) -> ShapingProxy:
    return ShapingProxy.start(*server.server_address[:2], StoreProfile.parse(spec))


def _connect(proxy: ShapingProxy) -> contextlib.closing[http.client.HTTPConnection]:
    return contextlib.closing(http.client.HTTPConnection(proxy.host, proxy.port,
                                                         timeout=_TIMEOUT_S))


def _timed(connection: http.client.HTTPConnection, method: str, path: str,
           body: Any = None, **kwargs: Any) -> tuple[float, float, bytes]:
    """Seconds to the response's head and to its end, and its body."""
    started = time.perf_counter()
    connection.request(method, path, body=body, **kwargs)
    response = connection.getresponse()
    head_s = time.perf_counter() - started
    data = response.read()
    assert response.status == 200, (response.status, data)
    return head_s, time.perf_counter() - started, data


def test_a_download_takes_at_least_its_bytes_over_the_down_bandwidth(server: _Server) -> None:
    nbytes, rate = 1 << 20, 4e6
    with _proxy(server, "loopback,down_bandwidth=4MB/s,up_bandwidth=1GB/s") as proxy, \
            _connect(proxy) as connection:
        _, total_s, data = _timed(connection, "GET", f"/bytes/{nbytes}")
        assert len(data) == nbytes
        assert total_s >= nbytes / rate
        assert proxy.wait_until(lambda s: s.down_bytes > nbytes, _TIMEOUT_S)


def test_an_upload_takes_at_least_its_bytes_over_the_up_bandwidth(server: _Server) -> None:
    nbytes, rate = 1 << 20, 8e6
    with _proxy(server, "loopback,up_bandwidth=8MB/s,down_bandwidth=1kB/s") as proxy, \
            _connect(proxy) as connection:
        _, total_s, _ = _timed(connection, "PUT", "/up", body=b"u" * nbytes)
        assert total_s >= nbytes / rate
        assert proxy.statistics().up_bytes > nbytes


def test_connections_share_the_node_bandwidth(server: _Server) -> None:
    """Two downloads at once take as long as their bytes together over the one rate."""
    nbytes, rate = 512 << 10, 4e6
    with _proxy(server, "loopback,bandwidth=4MB/s") as proxy:
        barrier = threading.Barrier(2)
        done: queue.Queue[int] = queue.Queue()

        def fetch() -> None:
            with _connect(proxy) as connection:
                barrier.wait(_TIMEOUT_S)
                done.put(len(_timed(connection, "GET", f"/bytes/{nbytes}")[2]))

        started = time.perf_counter()
        threads = [threading.Thread(target=fetch) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert time.perf_counter() - started >= 2 * nbytes / rate
        assert [done.get_nowait(), done.get_nowait()] == [nbytes, nbytes]
        assert proxy.statistics().num_connections == 2


def test_one_connection_is_held_to_the_connection_bandwidth(server: _Server) -> None:
    nbytes = 512 << 10
    with _proxy(server, "loopback,connection_bandwidth=2MB/s") as proxy, \
            _connect(proxy) as connection:
        assert _timed(connection, "GET", f"/bytes/{nbytes}")[1] >= nbytes / 2e6


def test_every_request_on_a_keep_alive_connection_waits_the_first_byte(
        server: _Server) -> None:
    """Plain, chunked, HEAD and chunked-upload requests in sequence on one connection: each
    response's head comes at least `first_byte` after its request was sent."""
    first_byte_s = 0.05
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/bytes/10", {}), ("GET", "/chunked/5000", {}), ("HEAD", "/x", {}),
        ("PUT", "/y", {"body": iter([b"a" * 3000, b"b" * 5]), "encode_chunked": True}),
        ("PUT", "/z", {"body": b"c" * 100}), ("GET", "/bytes/3", {})]
    with _proxy(server, "loopback,first_byte=50ms") as proxy, _connect(proxy) as connection:
        for method, path, kwargs in requests:
            head_s, _, data = _timed(connection, method, path, **kwargs)
            assert head_s >= first_byte_s, (method, path)
            assert len(data) == {"/bytes/10": 10, "/chunked/5000": 5000, "/bytes/3": 3}.get(
                path, 0)
        statistics = proxy.statistics()
    assert statistics.num_connections == 1
    assert statistics.num_requests == len(requests)
    assert statistics.num_slowdowns == 0


def _exchange(sock: socket.socket, request: bytes, *, head_only: bool = False) -> bytes:
    """Send `request`, return the whole response (head and Content-Length body)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0 if head_only else int(_header(head, b"content-length") or 0)
    while len(body) < length:
        body += _recv(sock)
    assert len(body) == length
    return head + b"\r\n\r\n" + body


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the connection ended before the response did"
    return chunk


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def test_a_request_over_the_limit_gets_slowdown_and_its_connection_stays_usable(
        server: _Server) -> None:
    held_request = b"GET /hold/4 HTTP/1.1\r\nHost: s\r\n\r\n"
    request = b"GET /bytes/5 HTTP/1.1\r\nHost: s\r\n\r\n"
    with _proxy(server, "loopback,max_in_flight=1") as proxy, \
            socket.create_connection((proxy.host, proxy.port), _TIMEOUT_S) as holder, \
            socket.create_connection((proxy.host, proxy.port), _TIMEOUT_S) as client:
        holder.sendall(held_request)
        assert server.held.get(timeout=_TIMEOUT_S) == "/hold/4"
        refused = _exchange(client, request)
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert _header(head, b"content-type") == b"application/xml"
        assert _header(head, b"retry-after") is None
        assert body.startswith(b"<?xml") and _SLOWDOWN_CODE in body
        server.release.set()
        held = _exchange(holder, b"")
        assert held.endswith(b"\r\n\r\nxxxx")
        assert proxy.wait_until(lambda s: s.num_in_flight == 0, _TIMEOUT_S)
        answered = _exchange(client, request)  # the same connection, now under the limit
        assert answered.startswith(b"HTTP/1.1 200 ")
        moved = (len(held_request) + 2 * len(request), len(held) + len(refused) + len(answered))
        assert proxy.wait_until(lambda s: (s.up_bytes, s.down_bytes, s.num_in_flight) == (
            *moved, 0), _TIMEOUT_S), proxy.statistics()
        statistics = proxy.statistics()
    assert statistics.num_connections == 2
    assert statistics.num_requests == 3
    assert statistics.num_slowdowns == 1
    assert statistics.peak_in_flight == 1


def test_a_refused_upload_gets_100_continue_its_body_is_dropped_then_slowdown(
        server: _Server) -> None:
    """The client asked for 100 Continue: the proxy answers it, reads the body whole (counted
    up, never forwarded), then answers 503; a refused HEAD gets 503 with no body."""
    upload = (b"PUT /up HTTP/1.1\r\nHost: s\r\nContent-Length: 1000\r\n"
              b"Expect: 100-continue\r\n\r\n")
    head_request = b"HEAD /x HTTP/1.1\r\nHost: s\r\n\r\n"
    held_request = b"GET /hold/1 HTTP/1.1\r\nHost: s\r\n\r\n"
    with _proxy(server, "loopback,max_in_flight=1,first_byte=20ms") as proxy, \
            socket.create_connection((proxy.host, proxy.port), _TIMEOUT_S) as holder, \
            socket.create_connection((proxy.host, proxy.port), _TIMEOUT_S) as client:
        holder.sendall(held_request)
        server.held.get(timeout=_TIMEOUT_S)
        interim = _exchange(client, upload)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        started = time.perf_counter()
        refused = _exchange(client, b"u" * 1000)
        assert time.perf_counter() - started >= 0.02
        assert refused.startswith(b"HTTP/1.1 503 ") and _SLOWDOWN_CODE in refused
        refused_head = _exchange(client, head_request, head_only=True)
        assert refused_head.startswith(b"HTTP/1.1 503 ")
        assert _header(refused_head, b"content-length") == b"0"
        moved = (len(held_request) + len(upload) + 1000 + len(head_request),
                 len(interim) + len(refused) + len(refused_head))
        assert proxy.wait_until(lambda s: (s.up_bytes, s.down_bytes) == moved, _TIMEOUT_S), \
            proxy.statistics()
        statistics = proxy.statistics()
        server.release.set()
    assert server.held.empty()  # nothing but the held request reached the server
    assert statistics.num_requests == 3
    assert statistics.num_slowdowns == 2


def test_100_continue_from_the_server_is_not_held_for_the_first_byte(server: _Server) -> None:
    """With a first byte of 60 s, the interim answer still comes (within the 10 s guard)."""
    with _proxy(server, "loopback,first_byte=60s") as proxy, \
            socket.create_connection((proxy.host, proxy.port), _TIMEOUT_S) as client:
        client.sendall(b"PUT /up HTTP/1.1\r\nHost: s\r\nContent-Length: 4\r\n"
                       b"Expect: 100-continue\r\n\r\n")
        assert _recv(client).startswith(b"HTTP/1.1 100 Continue\r\n")


def test_bytes_that_are_not_http_reset_the_connection(server: _Server,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with _proxy(server, "loopback") as proxy, \
            socket.create_connection((proxy.host, proxy.port), _TIMEOUT_S) as client:
        client.sendall(b"HELLO THERE\r\n\r\n")
        with pytest.raises(ConnectionResetError):
            client.recv(1)
        with _connect(proxy) as connection:  # other connections go on
            assert _timed(connection, "GET", "/bytes/7")[2] == b"x" * 7
    assert "request line 'HELLO THERE'" in caplog.text and "connection reset" in caplog.text


def test_stop_resets_open_connections_and_stopping_again_does_nothing(server: _Server) -> None:
    proxy = _proxy(server, "loopback,first_byte=60s")
    with socket.create_connection((proxy.host, proxy.port), _TIMEOUT_S) as client:
        client.sendall(b"GET /bytes/1 HTTP/1.1\r\nHost: s\r\n\r\n")
        assert proxy.wait_until(lambda s: s.num_in_flight == 1, _TIMEOUT_S)
        proxy.stop()
        with pytest.raises(ConnectionResetError):
            client.recv(1)
    proxy.stop()
    assert proxy.statistics().num_in_flight == 0
    assert not proxy.wait_until(lambda s: s.num_requests > 1, 0.01)


def test_botocore_retries_a_slowdown_through_seaweedfs(s3_env: Any) -> None:
    """A real S3 client and store: one request held in flight (a presigned upload whose body
    is half sent) makes the proxy refuse botocore's upload (it sends 100-continue first);
    once the held upload completes, botocore's retry succeeds, and every 503 the proxy
    answered is one botocore retried."""
    import botocore.session
    from botocore.config import Config

    env = s3_env.environment()
    host, _, port = s3_env.endpoint.removeprefix("http://").partition(":")
    with ShapingProxy.start(host, int(port), StoreProfile.parse(
            "loopback,max_in_flight=1,first_byte=5ms")) as proxy:
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=proxy.endpoint, region_name=env["AWS_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"},
                          retries={"mode": "standard", "max_attempts": 10}))
        bucket = s3_env.bucket
        url = client.generate_presigned_url("put_object", Params={
            "Bucket": bucket, "Key": "shaping/held"}, ExpiresIn=300)
        target = url.removeprefix(proxy.endpoint)
        with socket.create_connection((proxy.host, proxy.port), _TIMEOUT_S) as holder:
            holder.sendall(b"PUT %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Length: 8\r\n\r\nheld"
                           % (target.encode(), proxy.host.encode(), proxy.port))
            assert proxy.wait_until(lambda s: s.num_in_flight == 1, _TIMEOUT_S)
            answers: queue.Queue[Any] = queue.Queue()
            uploader = threading.Thread(target=lambda: answers.put(client.put_object(
                Bucket=bucket, Key="shaping/retried", Body=io.BytesIO(b"r" * 100_000))))
            uploader.start()
            assert proxy.wait_until(lambda s: s.num_slowdowns >= 1, _TIMEOUT_S)
            assert _exchange(holder, b"-up-").startswith(b"HTTP/1.1 200 ")
            uploader.join(_TIMEOUT_S * 3)
        retries = answers.get_nowait()["ResponseMetadata"]["RetryAttempts"]
        assert client.get_object(Bucket=bucket, Key="shaping/retried")["Body"].read() == \
            b"r" * 100_000
        assert client.get_object(Bucket=bucket, Key="shaping/held")["Body"].read() == \
            b"held-up-"
        client.close()
        statistics = proxy.statistics()
    assert retries >= 1
    assert statistics.num_slowdowns == retries
    assert statistics.num_requests == 1 + (retries + 1) + 2
    assert statistics.up_bytes >= 100_000 * (retries + 1)
    assert statistics.peak_in_flight == 1

