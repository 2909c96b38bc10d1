"""A proxy that makes a test store on 127.0.0.1 behave like a remote, shared one.

    with SeaweedFS.start(data_dir) as server, ShapingProxy.start(
            "127.0.0.1", port, StoreProfile.parse("s3-node")) as proxy:
        client = create_client("s3", endpoint_url=proxy.endpoint, ...)
        ...
        print(proxy.statistics())          # bytes each way, requests, 503s answered

One proxy models ONE node's network path to the store: every connection through it shares
its bandwidth (`StoreProfile`), so several processes of one node should all go through the
same proxy, and a multi-node run needs a proxy per node.

What it does to the bytes, each direction on its own:
- Bandwidth: bytes cross a per-direction link shared by every connection, one read after
  another (first come, first served), at the profile's rate, and a connection's own link at
  its per-connection rate, if any. A read of n bytes is forwarded only once both links have
  carried it (store and forward): n bytes take at least n / rate from the moment they reach
  the proxy, with no burst allowance, so a transfer of N bytes takes at least N / rate.
- First byte: the first byte of each response waits until at least `first_byte_s` after the
  last byte of its request went to the server (what S3 calls first-byte latency: from the
  complete request to the start of the response). The server's own time counts towards it;
  a response the server starts before its request is complete is held `first_byte_s` from
  when it arrives. Interim 100 Continue responses are not held.
- Requests in flight: from when a request's head reaches the proxy until its response's last
  byte has gone to the client. One beyond `max_requests_in_flight` is not forwarded: the proxy
  reads and drops its body (first answering 100 Continue if it asked) and answers S3's
  `503 SlowDown` itself, after the first-byte delay, with no Retry-After; the connection
  stays usable. A request pipelined behind another on its connection is always forwarded.

Mechanism: the proxy reads HTTP/1.1 framing (`_http_framing`: heads, Content-Length,
chunked coding) to know where each request ends and each response begins on keep-alive
connections, forwarding the bytes unchanged; what it holds per connection, and when each
chunk of bytes may go, is `_shaping`'s. One plain thread runs a `selectors` loop, with a
timer heap, on the machinery it shares with `TcpFaultProxy` (`_selector_proxy`; the code
under test may block its own loop). A connection whose bytes are not HTTP/1.1 as the framer
reads it is reset, with a warning. It costs about one CPU-second per GB moved: ~1 GB/s one
way on a core of its own, a third of a core for `s3-node`'s 352 MB/s (docs/benchmarks.md,
"The remote-store profile").
"""

from __future__ import annotations

import heapq
import logging
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from asynctron.testing._http_framing import Head, Piece, ProtocolError
from asynctron.testing._selector_proxy import SelectorProxy, listen
from asynctron.testing._shaping import (
    CONTINUE,
    Chunk,
    Connection,
    Link,
    Pipe,
    new_connection,
    slowdown,
)
from asynctron.testing.store_profile import StoreProfile

__all__ = ["ShapingProxy", "ShapingStatistics"]

logger = logging.getLogger(__name__)

_READ_BYTES = 256 << 10
_QUEUE_BYTES = 1 << 20
"""A direction of a connection stops reading while this many bytes wait in the proxy."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapingStatistics:
    """What went through a `ShapingProxy` since it started. Each count moves just after its
    socket call, so a client may hold its bytes a moment before the counts show them
    (`ShapingProxy.wait_until` waits for a count)."""

    num_connections: int
    """Client connections accepted."""
    num_requests: int
    """Requests the clients sent (heads read), refused ones included."""
    num_slowdowns: int
    """Requests the proxy refused with 503 SlowDown (over the in-flight limit)."""
    up_bytes: int
    """Client-to-store bytes carried: forwarded to the server, or read and dropped (the body
    of a refused request)."""
    down_bytes: int
    """Store-to-client bytes handed to the clients, the proxy's own answers included."""
    num_in_flight: int
    """Forwarded requests whose responses have not yet fully gone to the client."""
    peak_in_flight: int


class ShapingProxy(SelectorProxy[Connection, Pipe]):
    """A proxy on 127.0.0.1 to one upstream HTTP/1.1 store, shaping it as `profile` says.

    Not constructed directly; returned by `ShapingProxy.start`. `statistics`, `wait_until`
    and `stop` are thread-safe.
    """

    _label = "shaping proxy"

    def __init__(self, listener: socket.socket, upstream: tuple[str, int],
                 profile: StoreProfile) -> None:
        super().__init__(listener, upstream)
        self.profile = profile
        self._up_link = Link(profile.up_bandwidth_bytes_per_s)
        self._down_link = Link(profile.down_bandwidth_bytes_per_s)
        self._timers: list[tuple[float, int, Pipe, Connection]] = []
        self._timer_seq = 0
        # Shared with other threads, under `_cond`:
        self._counts = dict.fromkeys(("num_connections", "num_requests", "num_slowdowns",
                                      "up_bytes", "down_bytes", "num_in_flight",
                                      "peak_in_flight"), 0)
        """`ShapingStatistics`' fields; written by the proxy thread only."""

    @classmethod
    def start(cls, upstream_host: str, upstream_port: int,
              profile: StoreProfile) -> ShapingProxy:
        """Listen on a free 127.0.0.1 port and forward every connection to the upstream
        address, shaped as `profile` says, on a new thread. Listening when this returns."""
        proxy = cls(listen(), (upstream_host, upstream_port), profile)
        proxy._thread.start()
        return proxy

    def statistics(self) -> ShapingStatistics:
        """The counters now."""
        with self._cond:
            return self._statistics()

    def wait_until(self, predicate: Callable[[ShapingStatistics], bool],
                   timeout_s: float) -> bool:
        """Block until `predicate(self.statistics())` holds. Returns False if `timeout_s`
        passes first, or if the proxy stops before that."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or predicate(self._statistics()),
                                       timeout_s) and predicate(self._statistics())

    def __repr__(self) -> str:
        return (f"<ShapingProxy {self.host}:{self.port} -> {self.upstream[0]}:"
                f"{self.upstream[1]} {self.profile} {self.statistics()}>")

    def _statistics(self) -> ShapingStatistics:
        return ShapingStatistics(**self._counts)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._cond:
            counts = self._counts
            counts[name] += amount
            if name == "num_in_flight":
                counts["peak_in_flight"] = max(counts["peak_in_flight"], counts[name])
            self._cond.notify_all()

    # The proxy thread only, from here on.

    def _tick(self) -> float | None:
        """Service the pipes whose timers are due; how long until the next one."""
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            at, _, pipe, connection = heapq.heappop(self._timers)
            if pipe.timer_s == at:
                pipe.timer_s = None
            if not connection.closed:
                self._service(connection, pipe, now)
        return max(0.0, self._timers[0][0] - time.monotonic()) if self._timers else None

    def _admit(self, client: socket.socket) -> bool:
        self._count("num_connections")
        return True

    def _new_connection(self, client: socket.socket, upstream: socket.socket) -> Connection:
        return new_connection(client, upstream, self._up_link, self._down_link,
                              self.profile.connection_bandwidth_bytes_per_s)

    def _interest(self, out: Pipe, into: Pipe) -> int:
        """Read a socket unless its outgoing pipe ended or holds `_QUEUE_BYTES`; write it when
        its incoming pipe has more than the socket took."""
        events = 0
        if not out.eof and out.queued_bytes < _QUEUE_BYTES:
            events |= selectors.EVENT_READ
        if into.want_write:
            events |= selectors.EVENT_WRITE
        return events

    def _on_ready(self, connection: Connection, out: Pipe, into: Pipe, mask: int) -> None:
        now = time.monotonic()
        if mask & selectors.EVENT_WRITE:
            self._service(connection, into, now)
        if not connection.closed and mask & selectors.EVENT_READ:
            self._recv(connection, out, now)

    def _recv(self, connection: Connection, pipe: Pipe, now: float) -> None:
        try:
            data = pipe.src.recv(_READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            self._close(connection, reset=True)
            return
        try:
            pieces = pipe.framer.feed(data) if data else pipe.framer.feed_eof()
        except ProtocolError as error:
            logger.warning("shaping proxy %s:%d: %s %s; connection reset", self.host,
                           self.port, "request" if pipe.up else "response", error)
            self._close(connection, reset=True)
            return
        pipe.eof = not data
        for piece in pieces:
            if pipe.up:
                self._queue_request_piece(connection, piece, now)
            else:
                self._queue_response_piece(connection, piece, now)
        self._service(connection, pipe, now)
        if pipe.up and not connection.closed:  # it may have queued a 100 Continue
            self._service(connection, connection.down, now)

    def _queue_request_piece(self, connection: Connection, piece: Piece, now: float) -> None:
        head = piece.head
        if head is not None:
            self._count("num_requests")
            connection.up.message = head
            limit = self.profile.max_requests_in_flight
            connection.refusing = (limit is not None and connection.num_awaiting == 0
                                   and self._counts["num_in_flight"] >= limit)
            connection.num_awaiting += 1
            if connection.refusing:
                self._count("num_slowdowns")
                if head.expect_continue:
                    connection.down.queue(Chunk(CONTINUE, local=True), now)
            else:
                connection.methods.append(head.method)
                connection.num_forwarded_open += 1
                self._count("num_in_flight")
        connection.up.queue(Chunk(piece.data, drop=connection.refusing,
                                  end=connection.up.message if piece.end else None), now)

    def _queue_response_piece(self, connection: Connection, piece: Piece, now: float) -> None:
        chunk = Chunk(piece.data)
        head = piece.head
        if head is not None:
            connection.down.message = head
            if head.status >= 200:
                chunk.not_before_s = connection.response_began(now) + self.profile.first_byte_s
        if piece.end:
            chunk.end = connection.down.message
        connection.down.queue(chunk, now)

    def _service(self, connection: Connection, pipe: Pipe, now: float) -> None:
        """Send what is released, then set the pipe's next timer and socket events."""
        pipe.want_write = False
        while (chunk := pipe.released(now)) is not None:
            if not self._send(connection, pipe, chunk):
                return
            pipe.paid.popleft()
            pipe.queued_bytes -= len(chunk.data)
            if chunk.end is not None:
                self._on_message_sent(connection, pipe, chunk, now)
                if connection.closed:
                    return
        wake = pipe.wake_s()
        if wake is not None and not pipe.want_write and pipe.timer_s != wake:
            pipe.timer_s = wake
            self._timer_seq += 1
            heapq.heappush(self._timers, (wake, self._timer_seq, pipe, connection))
        if pipe.eof and not pipe.paid and not pipe.unpaid and not pipe.shut:
            self._pass_eof(connection, pipe)
            if connection.closed:
                return
        self._watch(connection)

    def _send(self, connection: Connection, pipe: Pipe, chunk: Chunk) -> bool:
        """Send the rest of `chunk`; False if the socket took only part of it, or failed."""
        if chunk.drop:
            self._count("up_bytes", len(chunk.data))
            return True
        sent = self._send_some(connection, pipe.dst, chunk.data[chunk.sent:])
        if sent is None:
            return False
        chunk.sent += sent
        if sent:
            self._count("up_bytes" if pipe.up else "down_bytes", sent)
        if chunk.sent < len(chunk.data):
            pipe.want_write = True
            self._watch(connection)
            return False
        return True

    def _on_message_sent(self, connection: Connection, pipe: Pipe, chunk: Chunk,
                         now: float) -> None:
        head = chunk.end
        assert head is not None
        if pipe.up and chunk.drop:  # a refused request, read whole: answer it
            connection.down.queue(Chunk(slowdown(head.method),
                                        not_before_s=now + self.profile.first_byte_s,
                                        end=Head(head.method, 503, False), local=True), now)
            self._service(connection, connection.down, now)
        elif pipe.up:
            connection.request_ended(now)
        elif head.status >= 200:
            connection.num_awaiting -= 1
            if not chunk.local:
                connection.num_forwarded_open -= 1
                self._count("num_in_flight", -1)

    def _close(self, connection: Connection, *, reset: bool) -> None:
        if not connection.closed:
            self._count("num_in_flight", -connection.num_forwarded_open)
        super()._close(connection, reset=reset)
