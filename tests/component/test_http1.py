"""The sidecar's lean HTTP/1.1 client (hop 1) against scripted servers on 127.0.0.1: each framing of a
reply, connection reuse, a kept-alive connection closed under it, and replies it must refuse."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from kairos.nodeagent.http1 import ConnectFailed, ConnectionBroken, Http1Client, ProtocolError
from tests.waiting import eventually

# A test server's conversation ends when the client under test hangs up, mid-request or between
# requests: that is no failure of the server.
CLIENT_GONE = (asyncio.IncompleteReadError, ConnectionError)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    return head, await reader.readexactly(length)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def replying(*replies: bytes, close: bool = False) -> tuple[Handler, list[tuple[bytes, bytes]], list[int]]:
    """A handler answering each request on a connection with the next reply; what it was sent;
    how many connections it took."""
    seen: list[tuple[bytes, bytes]] = []
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        with contextlib.suppress(*CLIENT_GONE):
            for reply in replies:
                seen.append(await read_request(reader))
                writer.write(reply)
                await writer.drain()
                if close:
                    break
        writer.close()

    return handler, seen, connections


OK_JSON = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n{"a": 1}'


async def test_a_post_and_its_content_length_reply_on_one_kept_alive_connection(serve) -> None:
    handler, seen, connections = replying(OK_JSON, OK_JSON)
    host = await serve(handler)
    client = Http1Client(1.0)
    for _ in range(2):
        reply = await client.request("POST", host, "/v1/completions", b'{"p": 1}', [("X-Request-Id", "r1")])
        assert (reply.status, reply.body, reply.headers["content-type"]) == (200, b'{"a": 1}', "application/json")
    await client.close()
    assert len(connections) == 1
    head, body = seen[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert f"Host: {host}".encode() in head and b"X-Request-Id: r1" in head and b"Content-Length: 8" in head
    assert body == b'{"p": 1}'


async def test_chunked_replies_with_extensions_and_trailers_are_joined(serve) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4;ext=1\r\nab\r\n\r\n3\r\ncde\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    handler, _, connections = replying(chunked, chunked)
    host = await serve(handler)
    client = Http1Client(1.0)
    for _ in range(2):
        assert (await client.request("POST", host, "/", b"x", [])).body == b"ab\r\ncde"
    await client.close()
    assert len(connections) == 1


async def test_interim_answers_are_skipped_and_a_close_delimited_body_read_to_the_end(serve) -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\r\nbusy"
    handler, _, connections = replying(reply, close=True)
    host = await serve(handler)
    client = Http1Client(1.0)
    for _ in range(2):  # the body ended with the connection: the second request takes a new one
        reply_read = await client.request("POST", host, "/", b"", [])
        assert (reply_read.status, reply_read.body) == (503, b"busy")
    await client.close()
    assert len(connections) == 2


async def test_a_kept_alive_connection_the_server_closed_is_replaced_once(serve) -> None:
    handler, seen, connections = replying(OK_JSON, close=True)  # one request per connection
    host = await serve(handler)
    client = Http1Client(1.0)
    await client.request("POST", host, "/", b"", [])
    # The reply kept the connection alive; the server has closed it since.
    await asyncio.sleep(0)
    assert (await client.request("POST", host, "/", b"", [])).status == 200
    await client.close()
    assert len(connections) == 2 and len(seen) == 2


async def test_a_request_its_kept_alive_connection_closed_under_is_sent_once_more(serve) -> None:
    """The race the idle check cannot see: the connection was open when taken, and the server
    closed it as the request arrived (an idle timeout), before any byte of a reply."""
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        with contextlib.suppress(*CLIENT_GONE):
            await read_request(reader)
            writer.write(OK_JSON)
            await writer.drain()
            if len(connections) == 1:
                await read_request(reader)  # the next request arrives; the server hangs up on it
        writer.close()

    host = await serve(handler)
    client = Http1Client(1.0)
    for _ in range(2):
        assert (await client.request("POST", host, "/", b"", [])).status == 200
    await client.close()
    assert len(connections) == 2


async def test_a_connection_cut_mid_reply_is_an_error_never_a_retry(serve) -> None:
    handler, seen, _ = replying(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part", close=True)
    host = await serve(handler)
    client = Http1Client(1.0)
    with pytest.raises(ConnectionBroken):
        await client.request("POST", host, "/", b"", [])
    await client.close()
    assert len(seen) == 1


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(b"SPDY/3 200 OK\r\n\r\n", id="not HTTP/1"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", id="negative length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n", id="header without colon"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", id="bad chunk size"),
    ],
)
async def test_replies_it_cannot_read_are_protocol_errors(serve, reply: bytes) -> None:
    handler, _, _ = replying(reply)
    host = await serve(handler)
    client = Http1Client(1.0)
    with pytest.raises(ProtocolError):
        await client.request("POST", host, "/", b"", [])
    await client.close()


async def test_a_refused_connection_says_why() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    client = Http1Client(1.0)
    with pytest.raises(ConnectFailed) as err:
        await client.request("POST", f"127.0.0.1:{port}", "/", b"", [])
    assert isinstance(err.value.os_error, ConnectionRefusedError)


async def test_a_cancelled_exchange_never_returns_its_connection_to_the_pool(serve) -> None:
    answer = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(*CLIENT_GONE):
            while True:
                await read_request(reader)
                await answer.wait()
                writer.write(OK_JSON)

    host = await serve(slow)
    client = Http1Client(1.0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await client.request("POST", host, "/", b"", [])
    answer.set()
    # The late reply to the cancelled request must not be read as this one's.
    assert (await client.request("POST", host, "/", b"", [])).body == b'{"a": 1}'
    await client.close()


def test_it_runs_on_uvloop_as_the_sidecar_does() -> None:
    async def exchange() -> int:
        handler, _, _ = replying(OK_JSON, OK_JSON)
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        host = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = Http1Client(1.0)
        try:
            return sum([(await client.request("POST", host, "/", b"", [])).status for _ in range(2)])
        finally:
            await client.close()
            server.close()
            await server.wait_closed()

    assert uvloop.run(exchange()) == 400


# ---------------------------------------------------------------------------------------------
# Streamed replies (hop 2: the local vLLM's answer relayed as it arrives)
# ---------------------------------------------------------------------------------------------
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def gated(first: bytes, rest: bytes, close: bool = False) -> tuple[Handler, asyncio.Event, list[int]]:
    """A handler that sends ``first``, then ``rest`` once the event is set, on each request
    (``close``: then closes the connection)."""
    gate = asyncio.Event()
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        with contextlib.suppress(*CLIENT_GONE):
            while True:
                await read_request(reader)
                writer.write(first)
                await writer.drain()
                await gate.wait()
                writer.write(rest)
                await writer.drain()
                if close:
                    break
        writer.close()

    return handler, gate, connections


async def read_all(resp) -> bytes:
    out = b""
    while data := await resp.read(2.0):
        out += data
    return out


@pytest.mark.parametrize(
    ("head", "first", "rest"),
    [
        pytest.param(SSE_HEAD, chunk(b"data: 1\n\n"), chunk(b"data: 2\n\n") + b"0\r\n\r\n", id="chunked"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 18\r\n\r\n", b"data: 1\n\n", b"data: 2\n\n", id="length"),
    ],
)
async def test_a_streamed_body_is_delivered_as_it_arrives_and_its_connection_reused(
    serve, head: bytes, first: bytes, rest: bytes
) -> None:
    handler, gate, connections = gated(head + first, rest)
    host = await serve(handler)
    client = Http1Client(1.0)
    resp = await client.open("POST", host, "/v1/completions", b"{}", [])
    assert resp.status == 200
    # The server holds the rest until the gate opens: the first event came through alone.
    assert await resp.read(2.0) == b"data: 1\n\n"
    gate.set()
    assert await read_all(resp) == b"data: 2\n\n"
    resp.close()
    resp = await client.open("POST", host, "/v1/completions", b"{}", [])  # read to its end: the same connection
    assert await read_all(resp) == b"data: 1\n\ndata: 2\n\n"
    resp.close()
    await client.close()
    assert len(connections) == 1


async def test_a_stream_closed_mid_body_drops_its_connection_so_the_server_sees_it(serve) -> None:
    handler, gate, connections = gated(SSE_HEAD + chunk(b"data: 1\n\n"), chunk(b"data: 2\n\n") + b"0\r\n\r\n")
    host = await serve(handler)
    client = Http1Client(1.0)
    resp = await client.open("POST", host, "/", b"{}", [])
    assert await resp.read(2.0) == b"data: 1\n\n"
    resp.close()
    gate.set()
    resp = await client.open("POST", host, "/", b"{}", [])
    assert await read_all(resp) == b"data: 1\n\ndata: 2\n\n"
    resp.close()
    await client.close()
    assert len(connections) == 2


async def test_silence_mid_body_is_a_timeout_and_a_break_comes_after_the_bytes_before_it(serve) -> None:
    handler, gate, _ = gated(SSE_HEAD + chunk(b"data: 1\n\n"), b"5\r\nda", close=True)
    host = await serve(handler)
    client = Http1Client(1.0)
    resp = await client.open("POST", host, "/", b"{}", [])
    assert await resp.read(2.0) == b"data: 1\n\n"
    with pytest.raises(TimeoutError):
        await resp.read(0.05)
    gate.set()
    assert await resp.read(2.0) == b"da"
    with pytest.raises(ConnectionBroken):
        await resp.read(2.0)
    resp.close()
    await client.close()


async def test_open_retries_a_kept_alive_connection_closed_while_idle_but_never_a_started_reply(serve) -> None:
    handler, seen, connections = replying(OK_JSON, close=True)
    host = await serve(handler)
    client = Http1Client(1.0)
    resp = await client.open("POST", host, "/", b"", [])
    assert await read_all(resp) == b'{"a": 1}'
    resp.close()
    await asyncio.sleep(0)  # the server closed the kept-alive connection
    resp = await client.open("POST", host, "/", b"", [])
    assert resp.status == 200
    resp.close()
    assert len(connections) == 2 and len(seen) == 2

    cut, cut_seen, _ = replying(b"HTTP/1.1 200 OK\r\nContent-Le", close=True)
    cut_host = await serve(cut)
    with pytest.raises(ConnectionBroken):
        await client.open("POST", cut_host, "/", b"", [])
    await client.close()
    assert len(cut_seen) == 1


async def test_a_large_body_read_slowly_arrives_whole(serve) -> None:
    """Past the high-water mark the client stops reading the socket until the reader catches up."""
    payload = bytes(range(256)) * 8192  # 2 MiB
    handler, _, _ = replying(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    host = await serve(handler)
    client = Http1Client(1.0)
    resp = await client.open("POST", host, "/", b"", [])
    conn = resp._conn
    assert conn is not None
    await eventually(lambda: conn._paused, what="the socket paused while the reader takes nothing")
    assert len(conn.body) < len(payload)
    got = bytearray()
    while data := await resp.read(2.0):
        got += data
        await asyncio.sleep(0)
    resp.close()
    await client.close()
    assert got == payload


async def test_head_get_and_raw_headers(serve) -> None:
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Thing: Y\r\n\r\n"
    handler, seen, connections = replying(reply, reply + b'{"a": 1}')
    host = await serve(handler)
    client = Http1Client(1.0)
    # HEAD: the reply has no body whatever its Content-Length says, and the connection stays usable.
    head_reply = await client.request("HEAD", host, "/v1/models", None, [])
    assert (head_reply.status, head_reply.body) == (200, b"")
    resp = await client.open("GET", host, "/v1/models", None, [])
    assert resp.head.raw_headers == (
        ("Content-Length", "8"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("X-Thing", "Y"),
    )
    assert await read_all(resp) == b'{"a": 1}'
    resp.close()
    await client.close()
    assert len(connections) == 1
    assert b"content-length" not in seen[1][0].lower()  # a GET without a body says none


def test_streaming_runs_on_uvloop_as_the_sidecar_does() -> None:
    async def exchange() -> bytes:
        handler, gate, _ = gated(SSE_HEAD + chunk(b"data: 1\n\n"), chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        gate.set()
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        host = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = Http1Client(1.0)
        try:
            out = b""
            for _ in range(2):
                resp = await client.open("POST", host, "/", b"{}", [])
                out += await read_all(resp)
                resp.close()
            return out
        finally:
            await client.close()
            server.close()
            await server.wait_closed()

    assert uvloop.run(exchange()) == b"data: 1\n\ndata: 2\n\n" * 2
