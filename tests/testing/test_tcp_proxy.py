"""TcpFaultProxy between a client socket and a tiny threaded server: each fault happens."""

from __future__ import annotations

import queue
import random
import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from asynctron.errors import ClosedError
from asynctron.testing.tcp_proxy import TcpFaultProxy

_TIMEOUT_S = 5.0


class _Server(socketserver.ThreadingTCPServer):
    """Reads each connection to its end, echoing what it reads when `echo`. Each connection
    puts (bytes received, "eof" or "reset") on `finished` when it ends."""

    daemon_threads = True

    def __init__(self, *, echo: bool) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.echo = echo
        self.finished: queue.Queue[tuple[bytes, str]] = queue.Queue()


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        received = bytearray()
        outcome = "eof"
        try:
            while chunk := self.request.recv(1 << 20):
                received += chunk
                if self.server.echo:
                    self.request.sendall(chunk)
        except (ConnectionResetError, BrokenPipeError):
            outcome = "reset"
        self.server.finished.put((bytes(received), outcome))


def _serve(echo: bool) -> Iterator[_Server]:
    server = _Server(echo=echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def echo_server() -> Iterator[_Server]:
    yield from _serve(echo=True)


@pytest.fixture
def sink_server() -> Iterator[_Server]:
    yield from _serve(echo=False)


@pytest.fixture
def echo_proxy(echo_server: _Server) -> Iterator[TcpFaultProxy]:
    with TcpFaultProxy.start(*echo_server.server_address) as proxy:
        yield proxy


@pytest.fixture
def sink_proxy(sink_server: _Server) -> Iterator[TcpFaultProxy]:
    with TcpFaultProxy.start(*sink_server.server_address) as proxy:
        yield proxy


def _connect(proxy: TcpFaultProxy) -> socket.socket:
    return socket.create_connection((proxy.host, proxy.port), timeout=_TIMEOUT_S)


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        assert chunk, f"EOF after {len(data)} of {nbytes} bytes"
        data += chunk
    return bytes(data)


def _recv_to_eof(sock: socket.socket) -> bytes:
    data = bytearray()
    while chunk := sock.recv(1 << 20):
        data += chunk
    return bytes(data)


def _assert_reset(proxy: TcpFaultProxy) -> None:
    """A new connection is reset: at connect, or at the first recv when the RST comes later."""
    with pytest.raises(ConnectionResetError), _connect(proxy) as client:
        client.recv(1)


def _roundtrip(sock: socket.socket) -> None:
    """Through an echo server: also proves the proxy has accepted this connection."""
    sock.sendall(b"ping")
    assert _recv_exactly(sock, 4) == b"ping"


def test_pass_through_forwards_every_byte_both_ways_and_the_eof(
        echo_proxy: TcpFaultProxy, echo_server: _Server) -> None:
    data = random.Random(0).randbytes(4 << 20)
    with _connect(echo_proxy) as client:
        def send() -> None:
            client.sendall(data)
            client.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        echoed = _recv_to_eof(client)
        sender.join()
    assert echoed == data
    assert echo_server.finished.get(timeout=_TIMEOUT_S) == (data, "eof")
    assert echo_proxy.bytes_up == echo_proxy.bytes_down == len(data)
    assert echo_proxy.connections_opened == 1
    assert echo_proxy.fault == "pass_through"


def test_wait_for_bytes_up_returns_once_the_bytes_went_through(
        echo_proxy: TcpFaultProxy) -> None:
    assert not echo_proxy.wait_for_bytes_up(1, timeout_s=0.01)
    with _connect(echo_proxy) as client:
        client.sendall(b"x" * 1000)
        assert echo_proxy.wait_for_bytes_up(1000, timeout_s=_TIMEOUT_S)
        assert _recv_exactly(client, 1000) == b"x" * 1000


def test_reset_resets_open_and_new_connections_until_pass_through(
        echo_proxy: TcpFaultProxy, echo_server: _Server) -> None:
    with _connect(echo_proxy) as client:
        _roundtrip(client)
        echo_proxy.reset()
        with pytest.raises(ConnectionResetError):
            client.recv(1)
    assert echo_server.finished.get(timeout=_TIMEOUT_S) == (b"ping", "reset")
    _assert_reset(echo_proxy)
    echo_proxy.pass_through()
    with _connect(echo_proxy) as client:
        _roundtrip(client)
    assert echo_proxy.connections_opened == 3


def test_refuse_fails_connects_and_keeps_open_connections(echo_proxy: TcpFaultProxy) -> None:
    with _connect(echo_proxy) as before:
        _roundtrip(before)
        echo_proxy.refuse()
        with pytest.raises(ConnectionRefusedError):
            _connect(echo_proxy)
        _roundtrip(before)
        echo_proxy.pass_through()
        with _connect(echo_proxy) as after:
            _roundtrip(after)
    assert echo_proxy.connections_opened == 2


def test_stall_holds_bytes_on_open_and_new_connections_until_pass_through(
        echo_proxy: TcpFaultProxy) -> None:
    with _connect(echo_proxy) as client:
        _roundtrip(client)
        echo_proxy.stall()
        with _connect(echo_proxy) as during:
            client.sendall(b"held")
            during.sendall(b"also")
            client.settimeout(0.2)
            with pytest.raises(TimeoutError):
                client.recv(4)
            assert echo_proxy.bytes_up == 4
            echo_proxy.pass_through()
            client.settimeout(_TIMEOUT_S)
            assert _recv_exactly(client, 4) == b"held"
            assert _recv_exactly(during, 4) == b"also"


def test_drop_after_cuts_after_exactly_nbytes_then_stays_reset(
        sink_proxy: TcpFaultProxy, sink_server: _Server) -> None:
    data = bytes(range(256)) * 40
    with _connect(sink_proxy) as client:
        sink_proxy.drop_after(1000)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            client.sendall(data)
            client.recv(1)
    assert sink_server.finished.get(timeout=_TIMEOUT_S) == (data[:1000], "reset")
    assert sink_proxy.bytes_up == 1000
    assert sink_proxy.fault == "reset"
    _assert_reset(sink_proxy)


def test_drop_after_counts_all_connections_then_passes_through(
        sink_proxy: TcpFaultProxy, sink_server: _Server) -> None:
    sink_proxy.drop_after(1000, then="pass_through")
    with _connect(sink_proxy) as first, _connect(sink_proxy) as second:
        first.sendall(b"a" * 600)
        assert sink_proxy.wait_for_bytes_up(600, timeout_s=_TIMEOUT_S)
        second.sendall(b"b" * 600)
        for client in (first, second):
            with pytest.raises(ConnectionResetError):
                client.recv(1)
    ends = sorted(sink_server.finished.get(timeout=_TIMEOUT_S) for _ in range(2))
    assert ends == [(b"a" * 600, "reset"), (b"b" * 400, "reset")]
    assert sink_proxy.fault == "pass_through"
    with _connect(sink_proxy) as client:
        client.sendall(b"after")
        client.shutdown(socket.SHUT_WR)
        assert _recv_to_eof(client) == b""
    assert sink_server.finished.get(timeout=_TIMEOUT_S) == (b"after", "eof")


def test_drop_after_zero_resets_now_and_arguments_are_checked(
        echo_proxy: TcpFaultProxy) -> None:
    with pytest.raises(ValueError, match=r"^drop_after nbytes: expected >= 0, found -1$"):
        echo_proxy.drop_after(-1)
    with pytest.raises(ValueError, match=r"^drop_after then: expected one of .*'drop_after'$"):
        echo_proxy.drop_after(1, then="drop_after")
    with _connect(echo_proxy) as client:
        _roundtrip(client)
        echo_proxy.drop_after(0)
        with pytest.raises(ConnectionResetError):
            client.recv(1)
    assert echo_proxy.fault == "reset"


def test_a_failed_upstream_connect_resets_the_client() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        with TcpFaultProxy.start("127.0.0.1", unused.getsockname()[1]) as proxy:
            _assert_reset(proxy)


def test_stop_resets_connections_frees_the_port_and_ends_the_thread(
        echo_server: _Server) -> None:
    proxy = TcpFaultProxy.start(*echo_server.server_address)
    with _connect(proxy) as client:
        _roundtrip(client)
        proxy.stop()
        with pytest.raises(ConnectionResetError):
            client.recv(1)
    assert f"tcp-fault-proxy-{proxy.port}" not in {t.name for t in threading.enumerate()}
    with pytest.raises(ConnectionRefusedError):
        _connect(proxy)
    with pytest.raises(ClosedError, match=r"^tcp fault proxy 127\.0\.0\.1:\d+: stopped"):
        proxy.stall()
    assert not proxy.wait_for_bytes_up(5, timeout_s=_TIMEOUT_S)
    proxy.stop()
