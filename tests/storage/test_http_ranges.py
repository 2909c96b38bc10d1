"""RangeClient against real sockets: a small HTTP server on 127.0.0.1 (on the test's loop)
answers each request as the test scripts it: bodies into the caller's buffers, error
documents however they are framed, keep-alive, stale connections, resets, stalls, garbage."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest

from asynctron.storage.backends.objects._http_ranges import HttpProtocolError, RangeClient

Respond = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


class ScriptedServer:
    """Reads each request's head and hands it to `respond` (per connection, in order)."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.connections = 0
        self.requests: list[bytes] = []
        self._writers: list[asyncio.StreamWriter] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                await self.respond(head, writer)
                if writer.is_closing():
                    return

    def close_idle(self) -> None:
        for writer in self._writers:
            writer.close()


@contextlib.asynccontextmanager
async def serving(respond: Respond) -> AsyncIterator[tuple[ScriptedServer, str]]:
    server = ScriptedServer(respond)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}/bucket/key?X-Amz-Signature=abc"
    finally:
        server.close_idle()
        listener.close()
        await listener.wait_closed()


def _head(status: str, **headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


DATA = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()


def _range_of(head: bytes) -> tuple[int, int]:
    line = next(line for line in head.split(b"\r\n") if line.lower().startswith(b"range:"))
    first, last = line.split(b"=")[1].split(b"-")
    return int(first), int(last)


async def _partial(head: bytes, writer: asyncio.StreamWriter) -> None:
    first, last = _range_of(head)
    body = DATA[first:last + 1]
    writer.write(_head("206 Partial Content", Content_Length=str(len(body))))
    for at in range(0, len(body), 100_003):  # uneven pieces: reads land across buffers
        writer.write(body[at:at + 100_003])
        await writer.drain()


def _client(read_timeout_s: float = 10.0) -> RangeClient:
    return RangeClient(connect_timeout_s=5.0, read_timeout_s=read_timeout_s)


async def test_a_body_lands_in_the_buffers_one_after_another_over_one_connection() -> None:
    async with serving(_partial) as (server, url):
        client = _client()
        try:
            for offset, sizes in ((0, (1 << 20,)), (5, (7, 300_000, 1 << 20)), (123, (1,))):
                buffers = [bytearray(size) for size in sizes]
                total = sum(sizes)
                answer = await client.get_into(
                    url, {"Range": f"bytes={offset}-{offset + total - 1}"},
                    [memoryview(buffer) for buffer in buffers])
                assert (answer.status, answer.received) == (206, total)
                assert b"".join(buffers) == DATA[offset:offset + total]
            assert server.connections == 1  # kept alive
            assert server.requests[0].startswith(b"GET /bucket/key?X-Amz-Signature=abc HTTP/1.1")
            assert b"Host: 127.0.0.1:" in server.requests[0]
        finally:
            await client.aclose()


async def test_a_typed_buffer_is_filled_as_bytes() -> None:
    async with serving(_partial) as (_, url):
        client = _client()
        target = np.zeros(1000, np.float32)
        try:
            answer = await client.get_into(url, {"Range": "bytes=0-3999"}, [memoryview(target)])
        finally:
            await client.aclose()
    assert answer.received == 4000 and target.tobytes() == DATA[:4000]


async def test_a_body_larger_than_the_buffers_is_left_unread_and_its_connection_closed(
        ) -> None:
    async def whole(head: bytes, writer: asyncio.StreamWriter) -> None:  # the range ignored
        writer.write(_head("200 OK", Content_Length=str(len(DATA))) + DATA)

    async with serving(whole) as (server, url):
        client = _client()
        try:
            buffer = bytearray(10)
            answer = await client.get_into(url, {"Range": "bytes=0-9"}, [memoryview(buffer)])
            assert (answer.status, answer.received, answer.content_length) == (200, 0, len(DATA))
            assert buffer == bytearray(10)
            await client.get_into(url, {}, [memoryview(bytearray(len(DATA)))])
            assert server.connections == 2
        finally:
            await client.aclose()


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_an_error_document_comes_back_whatever_its_framing(framing: str) -> None:
    document = b"<Error><Code>SlowDown</Code><Message>Please reduce your rate</Message></Error>"

    async def error(head: bytes, writer: asyncio.StreamWriter) -> None:
        if framing == "length":
            writer.write(_head("503 Slow Down", Content_Length=str(len(document))) + document)
        elif framing == "chunked":
            writer.write(_head("503 Slow Down", Transfer_Encoding="chunked"))
            for at in range(0, len(document), 10):
                piece = document[at:at + 10]
                writer.write(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            writer.write(b"0\r\nX-Trailer: 1\r\n\r\n")
        else:
            writer.write(_head("503 Slow Down", Connection="close") + document)
            await writer.drain()
            writer.close()

    async with serving(error) as (server, url):
        client = _client()
        try:
            for _ in range(2):
                answer = await client.get_into(url, {}, [memoryview(bytearray(8))])
                assert (answer.status, answer.body, answer.received) == (503, document, 0)
            assert server.connections == (2 if framing == "close" else 1)
        finally:
            await client.aclose()


async def test_a_keep_alive_connection_the_server_closed_is_replaced_unseen() -> None:
    async with serving(_partial) as (server, url):
        client = _client()
        try:
            await client.get_into(url, {"Range": "bytes=0-99"}, [memoryview(bytearray(100))])
            server.close_idle()  # the server times the idle connection out
            await asyncio.sleep(0.05)
            buffer = bytearray(100)
            answer = await client.get_into(url, {"Range": "bytes=100-199"},
                                           [memoryview(buffer)])
            assert answer.received == 100 and buffer == DATA[100:200]
            assert server.connections == 2
        finally:
            await client.aclose()


async def test_a_reset_mid_body_is_a_connection_error_and_the_connection_is_dropped() -> None:
    async def cut(head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(_head("206 Partial Content", Content_Length="1000") + DATA[:400])
        await writer.drain()
        writer.transport.abort()

    async with serving(cut) as (server, url):
        client = _client()
        try:
            with pytest.raises(ConnectionError, match="before the response ended"):
                await client.get_into(url, {}, [memoryview(bytearray(1000))])
            with pytest.raises(ConnectionError):
                await client.get_into(url, {}, [memoryview(bytearray(1000))])
            assert server.connections == 2  # the cut connection was not reused
        finally:
            await client.aclose()


async def test_a_server_that_stops_sending_times_out() -> None:
    async def stall(head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(_head("206 Partial Content", Content_Length="1000") + DATA[:10])
        await asyncio.sleep(30)

    async with serving(stall) as (_, url):
        client = _client(read_timeout_s=0.4)
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError, match="no byte of the response"):
                await client.get_into(url, {}, [memoryview(bytearray(1000))])
            assert asyncio.get_running_loop().time() - started < 5
        finally:
            await client.aclose()


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH_9.6\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000])
async def test_an_answer_that_is_not_http_fails_clearly(answer: bytes) -> None:
    async def garbage(head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)

    async with serving(garbage) as (_, url):
        client = _client()
        try:
            with pytest.raises(HttpProtocolError):
                await client.get_into(url, {}, [memoryview(bytearray(2))])
        finally:
            await client.aclose()


async def test_a_cancelled_get_closes_its_connection() -> None:
    started = asyncio.Event()

    async def slow(head: bytes, writer: asyncio.StreamWriter) -> None:
        if started.is_set():
            await _partial(head, writer)
            return
        writer.write(_head("206 Partial Content", Content_Length="1000") + DATA[:10])
        started.set()
        await asyncio.sleep(30)

    async with serving(slow) as (server, url):
        client = _client()
        try:
            task = asyncio.create_task(
                client.get_into(url, {"Range": "bytes=0-999"}, [memoryview(bytearray(1000))]))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            buffer = bytearray(10)
            await client.get_into(url, {"Range": "bytes=0-9"}, [memoryview(buffer)])
            assert buffer == DATA[:10] and server.connections == 2
        finally:
            await client.aclose()


async def test_nothing_listening_is_connection_refused() -> None:
    client = _client()
    try:
        with pytest.raises(ConnectionRefusedError):
            await client.get_into("http://127.0.0.1:1/x", {}, [memoryview(bytearray(1))])
        with pytest.raises(ValueError, match="expected an http"):
            await client.get_into("ftp://host/x", {}, [memoryview(bytearray(1))])
    finally:
        await client.aclose()
