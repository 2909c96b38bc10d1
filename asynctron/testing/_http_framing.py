"""Where each HTTP/1.1 message begins and ends in a byte stream, for `ShapingProxy`.

A `Framer` reads one direction of a connection (client requests, or server responses) and
cuts the bytes it is fed into `Piece`s at message boundaries: the first piece of a message
is its whole head (start line and headers, parsed into a `Head`), the last one is marked
`end`. Bodies are never decoded, only measured: `Content-Length`, `Transfer-Encoding:
chunked` (chunk sizes, chunk ends, trailers), or, for a response with neither, up to the
end of the connection. A response to HEAD, a 204 or 304 has no body; a 1xx response is
interim (the request's final response follows it). The bytes of the pieces, joined, are
exactly the bytes fed.

Not parsed (a `ProtocolError`): HTTP/2, a switch of protocols (101), a request body framed
by anything but chunked coding, a head over 64 KiB, a malformed start line, length or chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

_MAX_HEAD_BYTES = 64 << 10
_MAX_LINE_BYTES = 4 << 10
_HEAD_END = b"\r\n\r\n"

# What the framer reads next.
_HEAD, _FIXED, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _UNTIL_CLOSE = range(7)


class ProtocolError(ValueError):
    """The stream is not HTTP/1.1 as this framer reads it; the message says where."""


@dataclass(frozen=True, slots=True)
class Head:
    """A message's start line and the headers that frame it."""

    method: str
    """A request's method; for a response, the method of the request it answers ('' for an
    interim response)."""
    status: int
    """A response's status code; 0 for a request."""
    expect_continue: bool
    """A request with `Expect: 100-continue` (its body waits for a 100, or a final answer)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Consecutive bytes of one message."""

    data: bytes | memoryview
    head: Head | None = None
    """Set on a message's first piece, which is its whole head."""
    end: bool = False
    """The piece ends its message (it may also be its first: a message without a body)."""


class Framer:
    """Cuts one direction of an HTTP/1.1 connection into messages.

    Args:
        next_method: for responses, called once per final response head, returns the method
            of the request it answers (requests are answered in order), or None if no
            request awaits one; None for requests.
    """

    def __init__(self, next_method: Callable[[], str | None] | None) -> None:
        self._next_method = next_method
        self._state = _HEAD
        self._head = bytearray()
        self._line = bytearray()
        self._remaining_bytes = 0

    @property
    def responses(self) -> bool:
        return self._next_method is not None

    def feed(self, data: bytes) -> list[Piece]:
        """The pieces `data` holds, after what was fed before. A head split across feeds is
        kept until it is whole.

        Raises:
            ProtocolError: the bytes are not HTTP/1.1 as this framer reads it.
        """
        view = memoryview(data)
        pieces: list[Piece] = []
        pos = start = 0
        size = len(data)
        while pos < size:
            state = self._state
            if state == _HEAD:
                pos, piece = self._read_head(data, pos)
                start = pos
                if piece is not None:
                    pieces.append(piece)
                continue
            if state == _UNTIL_CLOSE:
                pos = size
            elif state in (_FIXED, _CHUNK_DATA):
                taken = min(self._remaining_bytes, size - pos)
                pos += taken
                self._remaining_bytes -= taken
                if self._remaining_bytes == 0:
                    self._state = _CHUNK_END if state == _CHUNK_DATA else _HEAD
            else:
                line, pos = self._read_line(data, pos)
                if line is not None:
                    self._on_line(line)
            if self._state == _HEAD:  # the message ended at pos
                pieces.append(Piece(view[start:pos], end=True))
                start = pos
        if start < size:
            pieces.append(Piece(view[start:size]))
        return pieces

    def feed_eof(self) -> list[Piece]:
        """The end of the stream: ends a response read up to the connection's end.

        Raises:
            ProtocolError: the stream ended inside a head.
        """
        if self._state == _UNTIL_CLOSE:
            self._state = _HEAD
            return [Piece(b"", end=True)]
        if self._state == _HEAD and self._head:
            raise ProtocolError(f"stream ended inside a head of {len(self._head)} bytes")
        return []

    def _read_head(self, data: bytes, pos: int) -> tuple[int, Piece | None]:
        """Hold head bytes from `data[pos:]` until the head is whole; then its piece, and
        where in `data` its body starts."""
        held = len(self._head)
        tail = bytes(self._head[-3:])
        straddling = (tail + data[pos:pos + 3]).find(_HEAD_END)  # an end split over feeds
        if held and straddling >= 0:
            used = straddling + len(_HEAD_END) - len(tail)
        else:
            found = data.find(_HEAD_END, pos, pos + _MAX_HEAD_BYTES + len(_HEAD_END) - held)
            if found < 0:
                self._head += data[pos:pos + _MAX_HEAD_BYTES + 1 - held]
                if len(self._head) > _MAX_HEAD_BYTES:
                    raise ProtocolError(f"head: expected at most {_MAX_HEAD_BYTES} bytes, "
                                        "found more with no end")
                return len(data), None
            used = found + len(_HEAD_END) - pos
        head_bytes = bytes(self._head) + data[pos:pos + used]
        self._head.clear()
        head, body = self._parse_head(head_bytes)
        return pos + used, Piece(head_bytes, head=head, end=body is None)

    def _parse_head(self, raw: bytes) -> tuple[Head, str | None]:
        """The head, and how its body is framed: None (no body), 'chunked', 'close', or the
        Content-Length as text. Sets the state to read that body."""
        lines = raw.decode("latin-1").split("\r\n")
        while lines and not lines[0]:  # empty lines before a start line are allowed
            lines.pop(0)
        start = lines[0].split(" ", 2)
        fields: dict[str, list[str]] = {}
        for line in lines[1:]:
            if line:
                name, colon, value = line.partition(":")
                if not colon or name != name.strip():
                    raise ProtocolError(f"header line {line[:80]!r}: expected 'name: value'")
                fields.setdefault(name.lower(), []).append(value.strip())
        codings = [c.strip().lower() for v in fields.get("transfer-encoding", ())
                   for c in v.split(",") if c.strip()]
        length = _content_length(fields.get("content-length"))
        if self.responses:
            if len(start) < 2 or not start[0].startswith("HTTP/1.") or not (
                    start[1].isdigit() and len(start[1]) == 3):
                raise ProtocolError(f"status line {lines[0][:80]!r}: expected 'HTTP/1.x "
                                    "<code> <reason>'")
            status = int(start[1])
            if status == 101:
                raise ProtocolError("status 101: a switch of protocols is not framed here")
            if status < 200:
                return self._frame(Head("", status, False), None)
            method = self._next_method()  # type: ignore[misc]
            if method is None:
                raise ProtocolError(f"status line {lines[0][:80]!r}: a response with no "
                                    "request awaiting it")
            head = Head(method, status, False)
            if method == "HEAD" or status in (204, 304):
                return self._frame(head, None)
            if codings:
                return self._frame(head, "chunked" if codings[-1] == "chunked" else "close")
            return self._frame(head, "close" if length is None else length)
        if len(start) != 3 or not start[2].startswith("HTTP/1.") or not start[0].isalpha():
            raise ProtocolError(f"request line {lines[0][:80]!r}: expected "
                                "'<method> <target> HTTP/1.x'")
        expect = any(v.lower() == "100-continue" for v in fields.get("expect", ()))
        head = Head(start[0], 0, expect)
        if codings:
            if codings[-1] != "chunked":
                raise ProtocolError(f"request transfer-encoding {codings!r}: expected chunked "
                                    "last")
            return self._frame(head, "chunked")
        return self._frame(head, None if length in (None, "0") else length)

    def _frame(self, head: Head, body: str | None) -> tuple[Head, str | None]:
        if body is None or body == "0":
            self._state = _HEAD
            return head, None
        if body == "chunked":
            self._state = _CHUNK_SIZE
        elif body == "close":
            self._state = _UNTIL_CLOSE
        else:
            self._state, self._remaining_bytes = _FIXED, int(body)
        return head, body

    def _read_line(self, data: bytes, pos: int) -> tuple[bytes | None, int]:
        """The next line of chunk framing, without its CRLF, once it is whole."""
        end = data.find(b"\n", pos)
        if end < 0:
            self._line += data[pos:]
            if len(self._line) > _MAX_LINE_BYTES:
                raise ProtocolError(f"chunk line: expected at most {_MAX_LINE_BYTES} bytes, "
                                    "found more with no end")
            return None, len(data)
        self._line += data[pos:end]
        line = bytes(self._line).removesuffix(b"\r")
        self._line.clear()
        return line, end + 1

    def _on_line(self, line: bytes) -> None:
        if self._state == _CHUNK_SIZE:
            text = line.split(b";", 1)[0].strip()
            try:
                size = int(text, 16)
            except ValueError:
                size = -1
            if size < 0 or not text:
                raise ProtocolError(f"chunk size line {line[:80]!r}: expected hex digits")
            if size:
                self._state, self._remaining_bytes = _CHUNK_DATA, size
            else:
                self._state = _TRAILER
        elif self._state == _CHUNK_END:
            if line:
                raise ProtocolError(f"chunk end: expected CRLF, found {line[:80]!r}")
            self._state = _CHUNK_SIZE
        elif not line:  # _TRAILER: an empty line ends the message
            self._state = _HEAD


def _content_length(values: list[str] | None) -> str | None:
    if values is None:
        return None
    found = {part.strip() for value in values for part in value.split(",")}
    if len(found) != 1 or not next(iter(found)).isdigit():
        raise ProtocolError(f"content-length {values!r}: expected one decimal length")
    return str(int(found.pop()))
