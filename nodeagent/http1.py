"""A lean HTTP/1.1 client for one kind of exchange: a request whose whole reply is read at once.

The sidecar's hop 1 (the prefill request) is one POST of a JSON body to a prefill node's vLLM and
one small JSON reply, on a kept-alive connection. aiohttp's client spends about 90 us of CPU on
such an exchange on this machine (its request, response and stream objects, timeout handles); this
one writes the request as one buffer and parses the reply in one protocol object, with nothing per
request but a future (the sidecar's CPU per keep request went down by about 0.2 ms). It reads
what HTTP/1.1 servers send (Content-Length, chunked, or a body ending at the close; 1xx answers
skipped) and keeps idle connections per host:port; what it cannot read is a :class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

_MAX_HEAD = 64 * 1024  # status line + headers
_MAX_BODY = 64 * 1024 * 1024  # a reply larger than this is refused, not buffered
_IDLE_PER_HOST = 64  # kept-alive connections held per host:port beyond this are closed


class Http1Error(Exception):
    """The exchange failed: no connection, or a reply that broke off or cannot be read."""


class ConnectFailed(Http1Error):
    """No connection could be made (``os_error`` says why)."""

    def __init__(self, hostport: str, os_error: OSError) -> None:
        super().__init__(f"cannot connect to {hostport}: {os_error}")
        self.os_error = os_error


class ProtocolError(Http1Error):
    """The server's reply is not HTTP/1.1 this client reads (or is over its bounds)."""


class ConnectionBroken(Http1Error):
    """The connection was closed or reset before the whole reply was in."""


class ClosedBeforeReply(ConnectionBroken):
    """The server closed the connection before the first byte of its reply."""


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header keeps its last value
    body: bytes


class _Exchange(asyncio.Protocol):
    """One connection; reads one reply at a time into a future."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buf = bytearray()
        self._reply: asyncio.Future[Reply] | None = None
        self._head: tuple[int, dict[str, str]] | None = None
        self._got_bytes = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        if self._reply is None or self._reply.done():
            self.close()  # bytes no request asked for: this connection is not to be trusted again
            return
        self._got_bytes = True
        self._buf += data
        try:
            reply = self._parse(eof=False)
        except ProtocolError as exc:
            self._fail(exc)
            return
        if reply is not None:
            self._reply.set_result(reply)

    def eof_received(self) -> bool:
        self._finish_at_close()
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish_at_close(exc)

    # the exchange
    def send(self, request: bytes) -> asyncio.Future[Reply]:
        assert self.transport is not None and self._reply is None
        self._buf.clear()
        self._head = None
        self._got_bytes = False
        self._reply = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._reply

    def reusable(self) -> bool:
        """Whether the reply just read left the connection ready for another request."""
        return not self.closed and not self._buf and self._reply is not None and self._reply.done()

    def reset(self) -> None:
        self._reply = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: BaseException) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(exc)
        self.close()

    def _finish_at_close(self, exc: Exception | None = None) -> None:
        self.closed = True
        if self._reply is None or self._reply.done():
            return
        try:
            reply = self._parse(eof=True)
        except ProtocolError as err:
            self._reply.set_exception(err)
            return
        if reply is not None:
            self._reply.set_result(reply)
        elif not self._got_bytes:
            self._reply.set_exception(ClosedBeforeReply("the server closed the connection before replying"))
        else:
            reason = f": {exc!r}" if exc is not None else ""
            self._reply.set_exception(ConnectionBroken(f"the connection closed mid-reply{reason}"))

    def _parse(self, eof: bool) -> Reply | None:
        """The reply, once all of it is in ``self._buf`` (None until then)."""
        while self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    raise ProtocolError("reply headers over 64 KiB")
                return None
            head = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
            del self._buf[: end + 4]
            status = _status(head[0])
            headers: dict[str, str] = {}
            for line in head[1:]:
                name, sep, value = line.partition(":")
                if not sep or not name or name != name.strip():
                    raise ProtocolError(f"bad header line {line[:80]!r}")
                headers[name.lower()] = value.strip()
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self._head = (status, headers)
        status, headers = self._head
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = _dechunk(self._buf)
            if body is None:
                return None
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit() or int(length) > _MAX_BODY:
                raise ProtocolError(f"bad Content-Length {length[:40]!r}")
            if len(self._buf) < int(length):
                return None
            body = bytes(self._buf[: int(length)])
            del self._buf[: int(length)]
        elif status in (204, 304):
            body = b""
        else:
            # Delimited by the close: complete only at EOF, and the connection is spent.
            if len(self._buf) > _MAX_BODY:
                raise ProtocolError("reply body over the client's bound")
            if not eof:
                return None
            body = bytes(self._buf)
            self._buf.clear()
            self.closed = True
        if headers.get("connection", "").lower() == "close":
            self.closed = True
        return Reply(status, headers, body)


def _status(line: str) -> int:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ProtocolError(f"bad status line {line[:80]!r}")
    return int(code)


def _dechunk(buf: bytearray) -> bytes | None:
    """The body of a complete chunked message at the start of ``buf`` (consumed), else None."""
    out = bytearray()
    pos = 0
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size_text = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ProtocolError(f"bad chunk size {size_text[:20]!r}") from None
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)  # the last chunk, then trailers (if any) and an empty line
            if end < 0:
                return None
            del buf[: end + 4]
            return bytes(out)
        start, stop = eol + 2, eol + 2 + size
        if len(out) + size > _MAX_BODY:
            raise ProtocolError("reply body over the client's bound")
        if len(buf) < stop + 2:
            return None
        if buf[stop : stop + 2] != b"\r\n":
            raise ProtocolError("chunk not followed by CRLF")
        out += buf[start:stop]
        pos = stop + 2


class Http1Client:
    """Kept-alive HTTP/1.1 connections per host:port, for requests whose reply is read whole.

    :meth:`request` raises :class:`ConnectFailed` when a connection cannot be made, TimeoutError
    when that takes over ``connect_timeout_s`` (the caller bounds the whole exchange), and another
    :class:`Http1Error` when the exchange breaks. A kept-alive connection that the server
    closed before replying (an idle timeout racing the request) is retried once on a new one.
    """

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[str, list[_Exchange]] = {}

    async def request(
        self, method: str, hostport: str, target: str, body: bytes, headers: Iterable[tuple[str, str]]
    ) -> Reply:
        head = [f"{method} {target} HTTP/1.1", f"Host: {hostport}", f"Content-Length: {len(body)}"]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} holds a line break")
            head.append(f"{name}: {value}")
        # Header text as aiohttp's server decoded it (UTF-8, surrogateescape): the bytes the client sent.
        request = ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
        conn = self._take(hostport)
        if conn is not None:
            try:
                return await self._exchange(hostport, conn, request)
            except ClosedBeforeReply:
                pass  # closed while idle: the request never reached it; once more on a new one
        return await self._exchange(hostport, await self._connect(hostport), request)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _take(self, hostport: str) -> _Exchange | None:
        conns = self._idle.get(hostport)
        while conns:
            conn = conns.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, hostport: str) -> _Exchange:
        host, _, port = hostport.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Exchange, host.strip("[]"), int(port))
        except OSError as exc:  # refused, unreachable, no such host (TimeoutError passes as it is)
            if isinstance(exc, TimeoutError):
                raise
            raise ConnectFailed(hostport, exc) from exc
        return conn

    async def _exchange(self, hostport: str, conn: _Exchange, request: bytes) -> Reply:
        try:
            reply = await conn.send(request)
        except BaseException:
            conn.close()  # cancelled or broken mid-exchange: its next bytes belong to no one
            raise
        if conn.reusable():
            conn.reset()
            idle = self._idle.setdefault(hostport, [])
            if len(idle) < _IDLE_PER_HOST:
                idle.append(conn)
                return reply
        conn.close()
        return reply
