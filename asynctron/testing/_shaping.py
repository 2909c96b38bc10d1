"""The state `ShapingProxy` keeps per connection, and the arithmetic of holding and pacing.

A `Pipe` is one direction of a connection. Bytes read into it become `Chunk`s, cut at HTTP
message boundaries, and go through two stages:
- unpaid: behind a response head that is still held (first-byte delay);
- paid: queued on the node's `Link` and the connection's own, each released once both have
  carried it (store and forward), then sent.
No sockets are touched here: the proxy sends what a pipe releases.
"""

from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass, field

from asynctron.testing import _selector_proxy
from asynctron.testing._http_framing import Framer, Head

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_SLOWDOWN_XML = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message>"
                 b"<RequestId>asynctron-shaping-proxy</RequestId></Error>")


class Link:
    """A path bytes cross one after another at `bytes_per_s` (None: no limit)."""

    __slots__ = ("bytes_per_s", "free_at_s")

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at_s = 0.0

    def carry(self, nbytes: int, now_s: float) -> float:
        """Queue `nbytes` behind what the link carries already; when they are across."""
        if self.bytes_per_s is None:
            return now_s
        self.free_at_s = max(now_s, self.free_at_s) + nbytes / self.bytes_per_s
        return self.free_at_s


@dataclass(eq=False, slots=True)
class Chunk:
    """Bytes waiting in a pipe."""

    data: bytes | memoryview
    not_before_s: float = 0.0
    """A response head: held until then (first-byte delay)."""
    release_s: float = 0.0
    """When its links have carried it (set once it is paid)."""
    sent: int = 0
    drop: bool = False
    """The body of a refused request: carried, then dropped."""
    end: Head | None = None
    """It ends a message: the head of that message."""
    local: bool = False
    """The proxy's own answer."""


@dataclass(eq=False, slots=True, kw_only=True)
class Pipe(_selector_proxy.Pipe):
    """One direction of a connection: bytes read from `src`, shaped, written to `dst`."""

    framer: Framer
    node: Link
    """The node's link this way, shared by every connection."""
    link: Link
    """This connection's own link this way."""
    unpaid: deque[Chunk] = field(default_factory=deque)
    paid: deque[Chunk] = field(default_factory=deque)
    queued_bytes: int = 0
    hold_s: float | None = None
    """The first unpaid chunk is held until then."""
    message: Head | None = None
    """The head of the message being read."""
    timer_s: float | None = None
    want_write: bool = False

    def queue(self, chunk: Chunk, now_s: float) -> None:
        self.unpaid.append(chunk)
        self.queued_bytes += len(chunk.data)
        if self.hold_s is None:
            self.pay(now_s)

    def pay(self, now_s: float) -> None:
        """Queue unpaid chunks on the links, in order, up to a response head still held."""
        while self.unpaid:
            chunk = self.unpaid[0]
            if chunk.not_before_s > now_s:
                self.hold_s = chunk.not_before_s
                return
            self.unpaid.popleft()
            nbytes = len(chunk.data)
            chunk.release_s = max(self.node.carry(nbytes, now_s),
                                  self.link.carry(nbytes, now_s))
            self.paid.append(chunk)
        self.hold_s = None

    def released(self, now_s: float) -> Chunk | None:
        """The next chunk to send, if its time has come (a passed hold is paid first)."""
        if self.hold_s is not None and self.hold_s <= now_s:
            self.pay(now_s)
        if self.paid and self.paid[0].release_s <= now_s:
            return self.paid[0]
        return None

    def wake_s(self) -> float | None:
        """When this pipe next has something to do, unless a socket wakes it first."""
        return self.paid[0].release_s if self.paid else self.hold_s


@dataclass(eq=False, slots=True, kw_only=True)
class Connection(_selector_proxy.Connection[Pipe]):
    """A client's connection and its own to the server, and the HTTP bookkeeping that pairs
    requests with responses."""

    methods: deque[str]
    """Forwarded requests' methods, for framing their responses (the down framer's)."""
    request_ends_s: deque[float] = field(default_factory=deque)
    """When forwarded requests went whole to the server, those whose responses have not
    begun."""
    num_requests_ended: int = 0
    num_responses_begun: int = 0
    num_awaiting: int = 0
    """Requests whose responses have not fully gone to the client (refused ones included)."""
    num_forwarded_open: int = 0
    """Forwarded requests whose responses have not fully gone to the client."""
    refusing: bool = False
    """The request being read now was refused."""

    def request_ended(self, now_s: float) -> None:
        """A forwarded request went whole to the server: its response counts from now."""
        if self.num_responses_begun <= self.num_requests_ended:
            self.request_ends_s.append(now_s)
        self.num_requests_ended += 1

    def response_began(self, now_s: float) -> float:
        """A final response's head came from the server: when its request ended (now, if the
        server answered before the request was whole)."""
        began = self.num_responses_begun
        self.num_responses_begun += 1
        return self.request_ends_s.popleft() if self.num_requests_ended > began else now_s


def new_connection(client: socket.socket, upstream: socket.socket, up_node: Link,
                   down_node: Link, connection_bytes_per_s: float | None) -> Connection:
    methods: deque[str] = deque()
    return Connection(
        client, upstream,
        Pipe(client, upstream, True, framer=Framer(None), node=up_node,
             link=Link(connection_bytes_per_s)),
        Pipe(upstream, client, False,
             framer=Framer(lambda: methods.popleft() if methods else None), node=down_node,
             link=Link(connection_bytes_per_s)),
        methods=methods)


def slowdown(method: str) -> bytes:
    """S3's answer to a request over its rate: 503 SlowDown, its XML error body (none for
    HEAD), no Retry-After."""
    body = b"" if method == "HEAD" else _SLOWDOWN_XML
    return (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
            b"Content-Length: %d\r\nx-amz-request-id: asynctron-shaping-proxy\r\n"
            b"Server: asynctron-shaping-proxy\r\n\r\n%s" % (len(body), body))
