"""The framer behind ShapingProxy: every message boundary, however the bytes are split."""

from __future__ import annotations

import random
from collections import deque

import pytest

from asynctron.testing._http_framing import Framer, Head, Piece, ProtocolError

REQUESTS = [
    b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n",
    b"PUT /b HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\nhello",
    b"\r\nPOST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n10\r\n0123456789abcdef\r\n0\r\nTrailer: 1\r\n\r\n",
    b"HEAD /d HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    b"DELETE /e HTTP/1.0\r\n\r\n",
]
METHODS = ["GET", "PUT", "POST", "HEAD", "DELETE"]
RESPONSES = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n",  # HEAD: no body
    b"HTTP/1.1 200 OK\r\n\r\nuntil the connection ends",
]


def _frame(framer: Framer, stream: bytes, rng: random.Random) -> list[Piece]:
    pieces: list[Piece] = []
    pos = 0
    while pos < len(stream):
        size = rng.randint(1, 24)
        pieces += framer.feed(stream[pos:pos + size])
        pos += size
    return pieces + framer.feed_eof()


def _messages(pieces: list[Piece]) -> list[tuple[Head, bytes]]:
    """Each message's head and bytes; every message starts with its head piece."""
    messages, current, head = [], b"", None
    for piece in pieces:
        if piece.head is not None:
            assert current == b"" and head is None
            head = piece.head
        assert head is not None
        current += bytes(piece.data)
        if piece.end:
            messages.append((head, current))
            current, head = b"", None
    assert current == b"" and head is None
    return messages


@pytest.mark.parametrize("seed", range(40))
def test_requests_are_cut_where_each_ends_however_the_bytes_arrive(seed: int) -> None:
    messages = _messages(_frame(Framer(None), b"".join(REQUESTS), random.Random(seed)))
    assert [data for _, data in messages] == REQUESTS
    assert [head.method for head, _ in messages] == METHODS
    assert [head.expect_continue for head, _ in messages] == [False, True, False, False, False]


@pytest.mark.parametrize("seed", range(40))
def test_responses_are_cut_by_their_requests_methods_and_statuses(seed: int) -> None:
    methods = deque(METHODS)
    framer = Framer(lambda: methods.popleft() if methods else None)
    messages = _messages(_frame(framer, b"".join(RESPONSES), random.Random(seed)))
    assert [data for _, data in messages] == RESPONSES
    assert [(head.method, head.status) for head, _ in messages] == [
        ("GET", 200), ("", 100), ("PUT", 200), ("POST", 200), ("HEAD", 200), ("DELETE", 200)]


def test_a_head_is_one_piece_and_a_body_passes_in_the_pieces_it_came_in() -> None:
    framer = Framer(None)
    assert framer.feed(b"PUT /b HTTP/1.1\r\nContent-") == []
    pieces = framer.feed(b"Length: 6\r\n\r\nab")
    assert [(bytes(p.data), p.head is not None, p.end) for p in pieces] == [
        (b"PUT /b HTTP/1.1\r\nContent-Length: 6\r\n\r\n", True, False), (b"ab", False, False)]
    pieces = framer.feed(b"cdefGET / HTTP/1.1\r\n\r\n")
    assert [(bytes(p.data), p.end) for p in pieces] == [
        (b"cdef", True), (b"GET / HTTP/1.1\r\n\r\n", True)]


@pytest.mark.parametrize(("stream", "message"), [
    (b"NOT HTTP\r\n\r\n", r"^request line 'NOT HTTP': expected '<method> <target> HTTP/1.x'$"),
    (b"PRI * HTTP/2.0\r\n\r\n", r"^request line 'PRI \* HTTP/2.0'"),
    (b"PUT / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
     r"^request transfer-encoding \['gzip'\]: expected chunked last$"),
    (b"PUT / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
     r"^content-length \['1', '2'\]: expected one decimal length$"),
    (b"PUT / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", r"content-length \['-1'\]"),
    (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", r"^header line 'no colon': expected 'name: value'$"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
     r"^chunk size line b'zz': expected hex digits$"),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\naXY\r\n",
     r"^chunk end: expected CRLF, found b'XY'$"),
    (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 20000, r"^head: expected at most 65536 bytes"),
])
def test_what_is_not_http_1_1_is_refused_with_where(stream: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        Framer(None).feed(stream)


def test_a_response_nobody_asked_for_and_a_protocol_switch_are_refused() -> None:
    with pytest.raises(ProtocolError, match=r"^status line 'HTTP/1.1 200 OK': a response with "
                                            r"no request awaiting it$"):
        Framer(lambda: None).feed(b"HTTP/1.1 200 OK\r\n\r\n")
    with pytest.raises(ProtocolError, match=r"^status 101: a switch of protocols"):
        Framer(lambda: "GET").feed(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    with pytest.raises(ProtocolError, match=r"^status line 'SPDY/3 200'"):
        Framer(lambda: "GET").feed(b"SPDY/3 200\r\n\r\n")


def test_a_stream_ending_inside_a_head_is_refused_and_between_messages_is_not() -> None:
    framer = Framer(None)
    framer.feed(b"GET / HTTP/1.1\r\n\r\n")
    assert framer.feed_eof() == []
    framer.feed(b"GET / HT")
    with pytest.raises(ProtocolError, match=r"^stream ended inside a head of 8 bytes$"):
        framer.feed_eof()
