"""The sidecar's lean HTTP/1.1 client (hop 1) against scripted servers on 127.0.0.1: each framing of a
reply, connection reuse, a kept-alive connection closed under it, and replies it must refuse."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from kairos.nodeagent.http1 import ConnectFailed, ConnectionBroken, Http1Client, ProtocolError

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
        try:
            for reply in replies:
                seen.append(await read_request(reader))
                writer.write(reply)
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
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
        try:
            while True:
                await read_request(reader)
                await answer.wait()
                writer.write(OK_JSON)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

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
