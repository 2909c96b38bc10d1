"""A TCP proxy for tests that puts network faults between a client and a real server.

    with SeaweedFS.start(data_dir) as server, TcpFaultProxy.start("127.0.0.1", port) as proxy:
        client = create_client("s3", endpoint_url=proxy.endpoint, ...)
        proxy.drop_after(8 << 20)                  # the server dies 8 MiB into the upload
        ...

Faults switch from any thread: `pass_through` (the default), `reset`, `refuse`, `stall`,
`drop_after` and `reset_each_after`. Each switch returns once the proxy has applied it, so
the next byte either side sends already meets the new fault. The counters
(`connections_opened`, `bytes_up`, `bytes_down`) and `wait_for_bytes_up` let a test act at
an exact point of a transfer without sleeping. The counters keep the names the tests use
rather than a `num_` prefix.

Mechanism: one plain thread runs a `selectors` loop over non-blocking sockets, on the
machinery shared with `ShapingProxy` (`_selector_proxy`). It does not use an asyncio loop.
The code under test owns the test's loop and may block it, so the proxy needs a thread of its
own either way. On that thread a selector loop gives the faults three things that asyncio
transports hide:
- a switch is applied between two socket operations, so no transport keeps flushing its buffer
  after `stall`;
- a reset is `SO_LINGER 0` and then close, on the real socket;
- `refuse` un-listens the listening socket in place (shutdown, then later listen again on the
  same port), so connects get ECONNREFUSED, as from a dead server.
Each read takes up to 1 MiB and is sent on at once. It is copied only when the peer takes part
of it, so the Python cost per syscall is small next to the bytes moved, well over 200 MB/s on
loopback.
"""

from __future__ import annotations

import selectors
import socket
import threading
from dataclasses import dataclass, field
from typing import Literal

from asynctron.errors import ClosedError
from asynctron.testing._selector_proxy import BACKLOG, Connection, Pipe, SelectorProxy, listen

__all__ = ["Fault", "TcpFaultProxy"]

Fault = Literal["pass_through", "reset", "refuse", "stall", "drop_after", "reset_each_after"]
"""What the proxy does now; each is the `TcpFaultProxy` method of that name."""

_CHUNK_BYTES = 1 << 20
_SWITCH_TIMEOUT_S = 5.0
_AFTER_DROP = ("pass_through", "reset", "refuse", "stall")


@dataclass(eq=False, slots=True, kw_only=True)
class _Pipe(Pipe):
    """A `Pipe` that forwards each read whole before it reads again."""

    pending: memoryview | None = None
    """Read from `src` and not yet taken by `dst`; nothing more is read until it is."""


@dataclass(eq=False, slots=True, kw_only=True)
class _Connection(Connection[_Pipe]):
    bytes_up: int = 0
    """Client-to-server bytes forwarded on this connection."""


@dataclass(eq=False, slots=True)
class _Switch:
    """A fault change, handed to the proxy thread. `done` is set once it is applied, with the
    `error` its listening socket raised if any, or once the proxy stopped first (leaving
    `applied` False)."""

    fault: Fault
    budget_bytes: int | None
    then: Fault
    applied: bool = False
    error: OSError | None = None
    done: threading.Event = field(default_factory=threading.Event)


class TcpFaultProxy(SelectorProxy[_Connection, _Pipe]):
    """A TCP proxy on 127.0.0.1 to one upstream address, injecting faults on demand.

    Not constructed directly; returned by `TcpFaultProxy.start`. Every method is thread-safe.
    A fault switch blocks until the proxy thread has applied it, which takes well under a
    millisecond. A connection whose upstream connect fails is reset. When one side of a
    connection resets, the proxy resets the other side too. An EOF is passed on as a
    half-close.
    """

    _label = "tcp fault proxy"

    def __init__(self, listener: socket.socket, upstream: tuple[str, int]) -> None:
        super().__init__(listener, upstream)
        self._listening = True
        self._buffer = bytearray(_CHUNK_BYTES)
        self._view = memoryview(self._buffer)
        self._budget_bytes: int | None = None
        self._per_connection_bytes: int | None = None
        self._then: Fault = "reset"
        # Shared with other threads, under `_cond`:
        self._fault: Fault = "pass_through"
        self._switches: list[_Switch] = []
        self._connections_opened = 0
        self._bytes_up = 0
        self._bytes_down = 0

    @classmethod
    def start(cls, upstream_host: str, upstream_port: int) -> TcpFaultProxy:
        """Listen on a free 127.0.0.1 port and forward every connection to the upstream
        address, on a new thread. The proxy is listening when this returns."""
        proxy = cls(listen(), (upstream_host, upstream_port))
        proxy._thread.start()
        return proxy

    @property
    def fault(self) -> Fault:
        """The fault in force now. After `drop_after` cuts, this is its `then`."""
        with self._cond:
            return self._fault

    @property
    def connections_opened(self) -> int:
        """Client connections accepted so far, counting those reset on accept."""
        with self._cond:
            return self._connections_opened

    @property
    def bytes_up(self) -> int:
        """Client-to-server bytes the proxy has handed to the server's socket."""
        with self._cond:
            return self._bytes_up

    @property
    def bytes_down(self) -> int:
        """Server-to-client bytes the proxy has handed to the client's socket."""
        with self._cond:
            return self._bytes_down

    def wait_for_bytes_up(self, nbytes: int, timeout_s: float) -> bool:
        """Block until `bytes_up` is at least `nbytes`. Returns False if `timeout_s` passes
        first, or if the proxy stops before that."""
        with self._cond:
            self._cond.wait_for(lambda: self._bytes_up >= nbytes or self._closed, timeout_s)
            return self._bytes_up >= nbytes

    def pass_through(self) -> None:
        """Forward bytes both ways, on open and new connections. Stalled bytes move on, and
        connects succeed again."""
        self._switch("pass_through")

    def reset(self) -> None:
        """Reset (RST) every open connection, both the client and the server side, now.
        Reset every new connection as soon as it is accepted: the client's connect fails with
        ECONNRESET, or succeeds and its next send or recv fails (ECONNRESET or EPIPE). Lasts
        until `pass_through`."""
        self._switch("reset")

    def refuse(self) -> None:
        """Stop listening, so new connects fail with ECONNREFUSED. Connections waiting to be
        accepted are reset. Open connections keep forwarding. Lasts until `pass_through`,
        which listens again on the same port."""
        self._switch("refuse")

    def stall(self) -> None:
        """Keep every connection, open or new, open but forward nothing either way. Bytes
        already read are held, and new connections are accepted and connected upstream. Lasts
        until `pass_through`."""
        self._switch("stall")

    def drop_after(self, nbytes: int, *, then: Fault = "reset") -> None:
        """Forward at most `nbytes` more client-to-server bytes, over all connections
        together, then reset every open connection (a server dying mid-upload) and switch to
        `then`. The default `then="reset"` keeps the server dead until `pass_through`.
        `then="pass_through"` lets a client's retry succeed. Until the cut, bytes flow both
        ways. Any bytes still in the kernel's send buffer at the cut are lost with the RST, as
        in a real crash.

        Raises:
            ValueError: `nbytes` is negative, or `then` is `"drop_after"`.
        """
        if nbytes < 0:
            raise ValueError(f"drop_after nbytes: expected >= 0, found {nbytes!r}")
        if then not in _AFTER_DROP:
            raise ValueError(f"drop_after then: expected one of {_AFTER_DROP!r}, found "
                             f"{then!r}")
        self._switch("drop_after", nbytes, then)

    def reset_each_after(self, nbytes: int) -> None:
        """Reset every connection, open or new, once it has forwarded `nbytes` client-to-server
        bytes (counted from its start): a store, or a path to it, that breaks every long
        upload while short requests still get through. Lasts until another fault.

        Raises:
            ValueError: `nbytes` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"reset_each_after nbytes: expected >= 0, found {nbytes!r}")
        self._switch("reset_each_after", nbytes)

    def __repr__(self) -> str:
        with self._cond:
            return (f"<TcpFaultProxy {self.host}:{self.port} -> {self.upstream[0]}:"
                    f"{self.upstream[1]} fault={self._fault!r} closed={self._closed} "
                    f"connections_opened={self._connections_opened} "
                    f"bytes_up={self._bytes_up} bytes_down={self._bytes_down}>")

    # Any thread: hand a switch to the proxy thread and wait for it.

    def _switch(self, fault: Fault, budget_bytes: int | None = None,
                then: Fault = "reset") -> None:
        switch = _Switch(fault, budget_bytes, then)
        with self._cond:
            if self._stop_requested or self._closed:
                raise ClosedError(f"tcp fault proxy {self.host}:{self.port}: stopped; start "
                                  "a new one")
            self._switches.append(switch)
        self._wake()
        if not switch.done.wait(_SWITCH_TIMEOUT_S):
            raise RuntimeError(f"tcp fault proxy {self.host}:{self.port}: expected {fault!r} "
                               f"applied within {_SWITCH_TIMEOUT_S} s, found it still queued")
        if not switch.applied:
            raise ClosedError(f"tcp fault proxy {self.host}:{self.port}: stopped before "
                              f"applying {fault!r}; start a new one")
        if switch.error is not None:
            raise switch.error

    # The proxy thread only, from here on.

    def _run(self) -> None:
        try:
            super()._run()
        finally:  # `_closed` is set: no switch is queued after these
            with self._cond:
                leftovers, self._switches = self._switches, []
            for switch in leftovers:
                switch.done.set()

    def _on_wake(self) -> None:
        super()._on_wake()
        with self._cond:
            switches, self._switches = self._switches, []
        for switch in switches:
            try:
                self._apply(switch.fault, switch.budget_bytes, switch.then)
            except OSError as exc:  # from listen or shutdown of the listening socket
                switch.error = exc
            switch.applied = True
            switch.done.set()

    def _apply(self, fault: Fault, budget_bytes: int | None = None,
               then: Fault = "reset") -> None:
        with self._cond:
            self._fault = fault
        self._budget_bytes = budget_bytes if fault == "drop_after" else None
        self._per_connection_bytes = budget_bytes if fault == "reset_each_after" else None
        self._then = then
        self._set_listening(fault != "refuse")
        if fault == "reset":
            for connection in list(self._connections):
                self._close(connection, reset=True)
        if self._budget_bytes == 0:
            self._cut()
            return
        if self._per_connection_bytes is not None:
            for connection in list(self._connections):
                if connection.bytes_up >= self._per_connection_bytes:
                    self._close(connection, reset=True)
        for connection in self._connections:
            self._watch(connection)

    def _cut(self) -> None:
        """`drop_after`'s budget is spent: switch to its `then`, then reset every connection
        (in that order, so a test woken by a reset already sees the new `fault`)."""
        connections = list(self._connections)
        self._apply(self._then)
        for connection in connections:
            self._close(connection, reset=True)

    def _set_listening(self, listening: bool) -> None:
        if listening == self._listening:
            return
        if listening:
            self._listener.listen(BACKLOG)
            self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
        else:
            self._selector.unregister(self._listener)
            # On Linux this un-listens the socket and keeps its port: connects get ECONNREFUSED.
            self._listener.shutdown(socket.SHUT_RD)
        self._listening = listening

    def _admit(self, client: socket.socket) -> bool:
        with self._cond:
            self._connections_opened += 1
        return self._fault != "reset"

    def _new_connection(self, client: socket.socket, upstream: socket.socket) -> _Connection:
        return _Connection(client, upstream, _Pipe(client, upstream, True),
                           _Pipe(upstream, client, False))

    def _interest(self, out: _Pipe, into: _Pipe) -> int:
        """Read a socket when its outgoing pipe has nothing pending, write it when its
        incoming pipe does, and nothing while stalled."""
        if self._fault == "stall":
            return 0
        events = 0
        if out.pending is None and not out.eof:
            events |= selectors.EVENT_READ
        if into.pending is not None:
            events |= selectors.EVENT_WRITE
        return events

    def _on_ready(self, connection: _Connection, out: _Pipe, into: _Pipe, mask: int) -> None:
        # Events selected before a switch in the same batch may be stale: check again.
        if self._fault == "stall":
            return
        if mask & selectors.EVENT_WRITE and into.pending is not None:
            self._send(connection, into)
        if (not connection.closed and mask & selectors.EVENT_READ and out.pending is None
                and not out.eof):
            self._recv(connection, out)
        if not connection.closed:
            self._watch(connection)

    def _recv(self, connection: _Connection, pipe: _Pipe) -> None:
        try:
            nbytes = pipe.src.recv_into(self._buffer)
        except BlockingIOError:
            return
        except OSError:
            self._close(connection, reset=True)
            return
        if nbytes:
            pipe.pending = self._view[:nbytes]
            self._send(connection, pipe)
            return
        pipe.eof = True
        self._pass_eof(connection, pipe)

    def _send(self, connection: _Connection, pipe: _Pipe) -> None:
        data = pipe.pending
        assert data is not None
        budget = self._budget_bytes if pipe.up else None
        limit = self._per_connection_bytes if pipe.up else None
        if limit is not None:
            budget = max(0, limit - connection.bytes_up)
        sent = self._send_some(connection, pipe.dst, data if budget is None else data[:budget])
        if sent is None:
            return
        if sent:
            with self._cond:
                if pipe.up:
                    self._bytes_up += sent
                    self._cond.notify_all()
                else:
                    self._bytes_down += sent
        if pipe.up:
            connection.bytes_up += sent
        if limit is not None:
            if connection.bytes_up >= limit:
                self._close(connection, reset=True)
                return
        elif budget is not None:
            self._budget_bytes = budget - sent
            if self._budget_bytes == 0:
                self._cut()
                return
        rest = data[sent:]
        if not rest:
            pipe.pending = None
        elif rest.obj is self._buffer:  # the next read reuses the buffer
            pipe.pending = memoryview(bytes(rest))
        else:
            pipe.pending = rest
