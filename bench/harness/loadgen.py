"""A small, fast HTTP/1.1 load generator and a fixed-answer upstream, both on raw asyncio.

- :class:`HttpConnection`: one keep-alive connection; requests are pre-encoded bytes, sent and
  read by the sidecar's own HTTP/1.1 client (:mod:`kairos.nodeagent.http1`: one protocol object
  per connection, nothing per request but a future), so the client costs tens of microseconds
  per request.
- :func:`sequential`: per-request latencies (``perf_counter_ns``) over one connection.
- :func:`closed_loop`: ``connections`` clients each sending back to back for ``seconds``.
- :func:`paced`: a fixed offered rate, spread over ``connections`` clients on a time grid.
- The upstream (``python -m bench.harness.loadgen upstream --port P``) answers every request at once
  with a small fixed OpenAI-like completion JSON, after reading the whole request body. It
  echoes ``x-upstream-body-bytes`` (bytes it received) and ``x-upstream-saw-route`` (the
  ``x-kairos-route`` header the dispatcher set, ``-`` if none), so a benchmark can check which
  path a request really took.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kairos.nodeagent.http1 import ConnectFailed, Http1Client, Http1Error, Reply, encode_request

UPSTREAM_BODY = (
    b'{"id":"cmpl-bench","object":"text_completion","created":0,"model":"kairos-tiny-llama",'
    b'"choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


class HttpError(Http1Error):
    """A status the caller did not expect."""


def build_request(host: str, port: int, path: str, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> bytes:
    """A complete keep-alive HTTP/1.1 POST of a JSON body, encoded once and sent as is."""
    return encode_request("POST", _hostport(host, port), path, body, [("Content-Type", "application/json"), *headers])


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class HttpConnection:
    """One keep-alive HTTP/1.1 connection (one request in flight at a time). A server that closed
    it while idle (vLLM's server does after 5 s, and a benchmark's paths take turns) gets a new
    one, as any pooling client reconnects: before the request when the close is in, and once
    more when the close crossed the request (no byte of a reply came). Raises ``OSError`` when no
    connection can be made, :class:`Http1Error` when a reply breaks off or cannot be read."""

    def __init__(self, host: str, port: int, client: Http1Client) -> None:
        self.host, self.port = host, port
        self._hostport = _hostport(host, port)
        self._client = client

    @classmethod
    async def open(cls, host: str, port: int, connect_timeout_s: float = 30.0) -> HttpConnection:
        conn = cls(host, port, Http1Client(connect_timeout_s))
        try:
            await conn._client.connect(conn._hostport)
        except ConnectFailed as exc:  # refused, unreachable: an OSError, as a socket says it
            raise exc.os_error from exc
        return conn

    @property
    def reconnects(self) -> int:
        """New connections opened after the first."""
        return max(0, self._client.connections_made - 1)

    @property
    def server_closed(self) -> bool:
        """Whether the server closed the idle connection (the next request opens another)."""
        return self._client.idle(self._hostport) == 0

    async def send(self, request: bytes) -> Reply:
        try:
            return await self._client.send(self._hostport, request)
        except ConnectFailed as exc:
            raise exc.os_error from exc

    async def close(self) -> None:
        await self._client.close()


async def post_once(host: str, port: int, path: str, body: bytes) -> Reply:
    """One POST on a connection of its own (a path's check before it is timed)."""
    conn = await HttpConnection.open(host, port)
    try:
        return await conn.send(build_request(host, port, path, body))
    finally:
        await conn.close()


async def sequential(conn: HttpConnection, request: bytes, n: int, expect_status: int = 200) -> list[int]:
    """Latency in ns of ``n`` requests sent one after the other on ``conn``."""
    samples: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        resp = await conn.send(request)
        samples.append(clock() - t0)
        if resp.status != expect_status:
            raise HttpError(f"status {resp.status}: {resp.body[:300]!r}")
    return samples


@dataclass
class LoadResult:
    connections: int
    seconds: float  # measured wall time of the run
    completed: int  # requests answered with the expected status
    errors: int  # other statuses, resets, malformed responses
    latencies_ns: list[int] = field(default_factory=list)
    late_sends: int = 0  # paced runs: requests sent after their slot (the client's connection was busy)

    @property
    def req_per_s(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0


async def closed_loop(
    host: str, port: int, request: bytes, connections: int, seconds: float, expect_status: int = 200
) -> LoadResult:
    """``connections`` keep-alive clients, each sending its next request as soon as the last is
    answered, for ``seconds``; requests still in flight at the end are waited for, not counted."""
    conns = [await HttpConnection.open(host, port) for _ in range(connections)]
    latencies: list[int] = []
    errors = 0
    clock = time.perf_counter_ns
    start = clock()
    deadline = start + int(seconds * 1e9)

    async def worker(conn: HttpConnection) -> None:
        nonlocal errors
        while True:
            t0 = clock()
            if t0 >= deadline:
                return
            try:
                resp = await conn.send(request)
            except (OSError, Http1Error):
                errors += 1
                return
            t1 = clock()
            if t1 > deadline:
                return
            if resp.status == expect_status:
                latencies.append(t1 - t0)
            else:
                errors += 1

    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for c in conns:
            await c.close()
    elapsed = (deadline - start) / 1e9
    return LoadResult(connections, elapsed, len(latencies), errors, latencies)


async def paced(
    host: str, port: int, request: bytes, rate_per_s: float, seconds: float, connections: int, expect_status: int = 200
) -> LoadResult:
    """An offered load of ``rate_per_s`` for ``seconds``, independent of how fast answers come:
    client ``i`` of ``connections`` sends at ``rate_per_s / connections`` on a grid offset by
    ``i / rate_per_s``, so the sends interleave evenly. A client whose last request is still
    in flight at its next slot sends as soon as it is answered (``late_sends`` counts those):
    with enough clients none is, and the rate holds."""
    if rate_per_s <= 0 or connections < 1:
        raise ValueError(f"need a positive rate and at least one connection, got {rate_per_s} and {connections}")
    conns = [await HttpConnection.open(host, port) for _ in range(connections)]
    latencies: list[int] = []
    errors = late = 0
    clock = time.perf_counter_ns
    start = clock()
    deadline = start + int(seconds * 1e9)
    interval = int(connections / rate_per_s * 1e9)

    async def worker(i: int, conn: HttpConnection) -> None:
        nonlocal errors, late
        due = start + int(i / rate_per_s * 1e9)
        while due < deadline:
            wait = due - clock()
            if wait > 0:
                await asyncio.sleep(wait / 1e9)
            elif wait < -1_000_000:  # over a millisecond behind its slot
                late += 1
            t0 = clock()
            try:
                resp = await conn.send(request)
            except (OSError, Http1Error):
                errors += 1
                return
            if resp.status == expect_status:
                latencies.append(clock() - t0)
            else:
                errors += 1
            due += interval

    try:
        await asyncio.gather(*(worker(i, c) for i, c in enumerate(conns)))
    finally:
        for c in conns:
            await c.close()
    return LoadResult(connections, seconds, len(latencies), errors, latencies, late)


# ---------------------------------------------------------------------------------------------
# The upstream
# ---------------------------------------------------------------------------------------------
class _UpstreamProtocol(asyncio.Protocol):
    """Reads each whole request (Content-Length or chunked), answers the fixed JSON at once."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while self._answer_one():
            pass

    def _answer_one(self) -> bool:
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(buf[:end]).lower()
        start = end + 4
        consumed, body_len = _body_extent(head, buf, start)
        if consumed < 0:
            return False  # the body is still arriving
        route = b"-"
        i = head.find(b"\r\nx-kairos-route:")
        if i >= 0:
            j = head.find(b"\r\n", i + 2)
            route = head[i + 17 : j if j >= 0 else len(head)].strip() or b"-"
        del buf[:consumed]
        assert self._transport is not None
        self._transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"x-upstream-body-bytes: %d\r\nx-upstream-saw-route: %s\r\n\r\n%s"
            % (len(UPSTREAM_BODY), body_len, route, UPSTREAM_BODY)
        )
        return True


def _body_extent(head: bytes, buf: bytearray, start: int) -> tuple[int, int]:
    """(bytes of the request including its body, body bytes), or (-1, 0) while incomplete."""
    i = head.find(b"\r\ncontent-length:")
    if i >= 0:
        j = head.find(b"\r\n", i + 2)
        length = int(head[i + 17 : j if j >= 0 else len(head)])
        return (start + length, length) if len(buf) >= start + length else (-1, 0)
    if b"\r\ntransfer-encoding: chunked" in head:
        pos, total = start, 0
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return -1, 0
            size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
            pos = eol + 2
            if size == 0:
                # No trailers from our clients: the final CRLF follows the zero chunk.
                return (pos + 2, total) if len(buf) >= pos + 2 else (-1, 0)
            if len(buf) < pos + size + 2:
                return -1, 0
            pos += size + 2
            total += size
    return start, 0


async def serve_upstream(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_UpstreamProtocol, host, port, reuse_address=True, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"upstream listening on {host}:{port}", flush=True)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upstream", help="serve the fixed completion JSON")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve_upstream(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
