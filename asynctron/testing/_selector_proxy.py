"""What the test proxies share: a thread running a `selectors` loop that accepts clients on
127.0.0.1 and connects each to one upstream address.

`SelectorProxy` owns the listening socket, the thread and its wake-up socket pair, `stop`,
accepting (with the upstream connect), each socket's interest in the selector, and a
connection's end: a send that fails resets it (`_send_some`), an EOF passes on as a
half-close (`_pass_eof`), and it closes with FIN once both ways are shut, or with RST. A
subclass owns what happens to the bytes, through the hooks `_admit`, `_new_connection`,
`_interest`, `_on_ready` and `_tick`, each called on the proxy thread. One that hands work to
the thread extends `_on_wake` (another thread called `_wake`) to take it, and `_run` to
release what is left when the thread ends.

Threading: only the proxy thread touches the sockets, the selector and the connections. Other
threads share only what is under `_cond`: `_stop_requested`, `_closed` (set, and `_cond`
notified, once the thread has closed every socket) and what a subclass keeps there.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar

BACKLOG = 128
_HOST = "127.0.0.1"
_BIND_ATTEMPTS = 16
_CONNECT_TIMEOUT_S = 2.0
_STOP_TIMEOUT_S = 2.0
_LINGER_ZERO = struct.pack("ii", 1, 0)


@dataclass(eq=False, slots=True)
class Pipe:
    """One direction of a connection: bytes read from `src` go to `dst`."""

    src: socket.socket
    dst: socket.socket
    up: bool
    """Client to server."""
    eof: bool = False
    """`src` sent EOF."""
    shut: bool = False
    """`dst` was shut down for writing (`_pass_eof`)."""


P = TypeVar("P", bound=Pipe)


@dataclass(eq=False, slots=True)
class Connection(Generic[P]):
    """A client's connection and the proxy's own to the upstream address."""

    client: socket.socket
    upstream: socket.socket
    up: P
    down: P
    closed: bool = False


C = TypeVar("C", bound=Connection[Any])


class SelectorProxy(ABC, Generic[C, P]):
    """A proxy on 127.0.0.1 to one upstream address, run by a thread of its own.

    `endpoint`, `stop` and the context manager are thread-safe; the rest is the proxy
    thread's.
    """

    _label: ClassVar[str]
    """What error messages call the proxy, e.g. "shaping proxy"; its thread is named after
    it."""

    def __init__(self, listener: socket.socket, upstream: tuple[str, int]) -> None:
        self.host, self.port = listener.getsockname()[:2]
        self.upstream = upstream
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._connections: set[C] = set()
        self._running = True
        # Shared with other threads, under `_cond`:
        self._cond = threading.Condition()
        self._stop_requested = False
        self._closed = False
        self._selector.register(listener, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        self._thread = threading.Thread(
            target=self._run, name=f"{self._label.replace(' ', '-')}-{self.port}", daemon=True)

    @property
    def endpoint(self) -> str:
        """`http://127.0.0.1:<port>`, the URL to give the client instead of the upstream's."""
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """Reset every connection, close every socket and join the thread (within about 2 s).
        Stopping again does nothing.

        Raises:
            RuntimeError: the thread did not end within 2 s.
        """
        with self._cond:
            self._stop_requested = True
        self._wake()
        self._thread.join(_STOP_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError(f"{self._label} {self.host}:{self.port}: expected its thread "
                               f"to end within {_STOP_TIMEOUT_S} s, found it running")
        self._wake_w.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wake(self) -> None:
        """Any thread: make the proxy thread run `_on_wake` soon."""
        # Full buffer: a wake is pending anyway. Closed: the proxy has stopped.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    # The proxy thread only, from here on. The hooks:

    @abstractmethod
    def _admit(self, client: socket.socket) -> bool:
        """A client was just accepted: count it. False: reset it, with no upstream connect."""

    @abstractmethod
    def _new_connection(self, client: socket.socket, upstream: socket.socket) -> C:
        """The connection to forward between `client` and its `upstream` (both non-blocking,
        TCP_NODELAY); the proxy adds it to `_connections` and watches it."""

    @abstractmethod
    def _interest(self, out: P, into: P) -> int:
        """The selector events (0: none) a socket waits for, given the pipe that reads it
        (`out`) and the one that writes it (`into`)."""

    @abstractmethod
    def _on_ready(self, connection: C, out: P, into: P, mask: int) -> None:
        """A socket of `connection`, open still, is ready for `mask`: `out` reads it and
        `into` writes it."""

    def _tick(self) -> float | None:
        """Run what is due between two selects; how long the next may wait for sockets (None:
        until one is ready)."""
        return None

    # The machinery:

    def _run(self) -> None:
        try:
            while self._running:
                for key, mask in self._selector.select(self._tick()):
                    if callable(key.data):  # the listener or the wake-up socket
                        key.data()
                    elif not key.data.closed:  # else closed by an earlier event of the batch
                        connection = key.data
                        out, into = ((connection.up, connection.down)
                                     if key.fileobj is connection.client
                                     else (connection.down, connection.up))
                        self._on_ready(connection, out, into, mask)
        finally:
            for connection in list(self._connections):
                self._close(connection, reset=True)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)
        with self._cond:
            self._running = not self._stop_requested

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # nothing left to accept, or it was reset while queued
                return
            if not self._admit(client):
                _abort(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=_CONNECT_TIMEOUT_S)
            except OSError:
                _abort(client)
                continue
            for sock in (client, upstream):
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = self._new_connection(client, upstream)
            self._connections.add(connection)
            self._watch(connection)

    def _watch(self, connection: C) -> None:
        """Register each socket of `connection` for what `_interest` says it waits for."""
        for sock, out, into in ((connection.client, connection.up, connection.down),
                                (connection.upstream, connection.down, connection.up)):
            events = self._interest(out, into)
            try:
                key = self._selector.get_key(sock)
            except KeyError:
                if events:
                    self._selector.register(sock, events, connection)
                continue
            if not events:
                self._selector.unregister(sock)
            elif key.events != events:
                self._selector.modify(sock, events, connection)

    def _send_some(self, connection: C, sock: socket.socket,
                   data: bytes | memoryview) -> int | None:
        """Send what `sock` takes of `data`: how many bytes (0 if its buffer is full), or None
        if the send failed, which resets `connection`."""
        try:
            return sock.send(data)
        except BlockingIOError:
            return 0
        except OSError:
            self._close(connection, reset=True)
            return None

    def _pass_eof(self, connection: C, pipe: P) -> None:
        """Pass `pipe.src`'s EOF on: shut `pipe.dst` down for writing (a half-close), and close
        `connection` once both ways are shut. A failed shutdown resets `connection`."""
        pipe.shut = True
        try:
            pipe.dst.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(connection, reset=True)
            return
        if connection.up.shut and connection.down.shut:
            self._close(connection, reset=False)

    def _close(self, connection: C, *, reset: bool) -> None:
        """Close both sockets of `connection`: with RST if `reset`, else FIN. Closing again
        does nothing."""
        if connection.closed:
            return
        connection.closed = True
        self._connections.discard(connection)
        for sock in (connection.client, connection.upstream):
            with contextlib.suppress(KeyError):
                self._selector.unregister(sock)
            if reset:
                _abort(sock)
            else:
                sock.close()


def listen() -> socket.socket:
    """A non-blocking socket listening on a free 127.0.0.1 port that it bound explicitly. A
    socket bound through port 0 would lose its port when `TcpFaultProxy.refuse` un-listens
    it."""
    error: OSError | None = None
    for _ in range(_BIND_ATTEMPTS):
        with socket.socket() as probe:
            probe.bind((_HOST, 0))
            port = probe.getsockname()[1]
        listener = socket.socket()
        # Else listening again after `refuse` fails (EADDRINUSE) while a connection is open.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((_HOST, port))
        except OSError as exc:  # taken between the probe and the bind
            listener.close()
            error = exc
            continue
        listener.listen(BACKLOG)
        listener.setblocking(False)
        return listener
    assert error is not None
    raise error


def _abort(sock: socket.socket) -> None:
    """Close with RST rather than FIN (SO_LINGER 0); any unsent bytes are dropped."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
    sock.close()
