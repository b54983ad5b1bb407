"""The benchmarks' HTTP/1.1 client (bench/harness/loadgen.py) against a server that closes idle
connections, as vLLM's does after 5 s: no request is lost to a connection the server closed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from bench.harness.loadgen import HttpConnection, build_request
from kairos.launcher.processes import free_port
from tests.waiting import eventually

REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@asynccontextmanager
async def server(close_after_reply: bool) -> AsyncIterator[int]:
    """Answers requests; with ``close_after_reply`` it closes each connection once it answered
    (an idle close that is already in when the next request comes), else it closes a connection
    unanswered when a second request comes on it (the close crossing the request)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                if answered and not close_after_reply:
                    return
                writer.write(REPLY)
                await writer.drain()
                answered += 1
                if close_after_reply:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        await srv.wait_closed()


@asynccontextmanager
async def client(close_after_reply: bool) -> AsyncIterator[tuple[HttpConnection, bytes]]:
    """A connection to :func:`server` and the request to send on it."""
    async with server(close_after_reply) as port:
        conn = await HttpConnection.open("127.0.0.1", port)
        try:
            yield conn, build_request("127.0.0.1", port, "/v1/completions", b"{}")
        finally:
            await conn.close()


async def test_a_connection_the_server_closed_while_idle_is_reopened() -> None:
    async with client(close_after_reply=True) as (conn, request):
        assert (await conn.send(request)).body == b"ok"
        await eventually(lambda: conn.server_closed, timeout_s=20)
        assert (await conn.send(request)).body == b"ok"
        assert conn.reconnects == 1


async def test_a_close_that_crosses_the_request_is_retried_once_on_a_new_connection() -> None:
    async with client(close_after_reply=False) as (conn, request):
        assert [(await conn.send(request)).body for _ in range(3)] == [b"ok"] * 3
        assert conn.reconnects == 2  # every second request on a connection met its close


async def test_no_server_is_an_os_error_as_a_socket_says_it() -> None:
    with pytest.raises(ConnectionRefusedError):
        await HttpConnection.open("127.0.0.1", free_port())  # reserved: nothing listens there
