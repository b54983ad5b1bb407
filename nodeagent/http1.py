"""A lean HTTP/1.1 client for the sidecar's two hops: a reply read whole, or streamed as it arrives.

Hop 1 (the prefill request) is one POST of a JSON body to a prefill node's vLLM and one small
JSON reply (:meth:`Http1Client.request`); hop 2 is the request to the local vLLM, whose reply
the sidecar relays as it arrives, SSE chunk by chunk (:meth:`Http1Client.open`). aiohttp's client
spends about 90 us of CPU on such an exchange on this machine (its request, response and stream
objects, timeout handles); this one writes the request as one buffer and reads the reply in one
protocol object per kept-alive connection, with nothing per request but a future. It reads what
HTTP/1.1 servers send (Content-Length, chunked, or a body ending at the close; 1xx answers
skipped), delivers a streamed body in the pieces it arrives in (chunk framing removed) and keeps
idle connections per host:port; what it cannot read is a :class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

_MAX_HEAD = 64 * 1024  # status line + headers; chunk-size lines and trailers too
_MAX_BODY = 64 * 1024 * 1024  # a reply read whole larger than this is refused, not buffered
_IDLE_PER_HOST = 64  # kept-alive connections held per host:port beyond this are closed
# A streamed body the reader has not taken yet: past this the socket is not read until it does.
_STREAM_HIGH_WATER = 256 * 1024


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
class Head:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header keeps its last value
    raw_headers: tuple[tuple[str, str], ...]  # as sent: names' case and repeated headers kept

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters ("" when there is none)."""
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header keeps its last value
    body: bytes


# How a reply's body ends (RFC 9112 §6.3).
_NO_BODY, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(4)
# Where the chunked decoder is.
_CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _CHUNK_TRAILERS = range(4)


class _Exchange(asyncio.Protocol):
    """One connection; reads one reply at a time: whole into a future, or its head into a future
    and its body, as it comes, for :class:`Response` to take."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buf = bytearray()  # received bytes not parsed yet
        self._ready: asyncio.Future[Reply | Head] | None = None  # None: no exchange in progress
        self._stream = False  # resolve _ready with the head (True) or the whole reply
        self._head_only = False  # a reply to HEAD: no body whatever its headers say
        self._head: Head | None = None
        self._framing = _NO_BODY
        self._left = 0  # bytes left of a Content-Length body or of the current chunk
        self._chunk = _CHUNK_SIZE
        self.body = bytearray()  # decoded body bytes not taken yet
        self.complete = False  # the whole body is in self.body (or was taken from it)
        self.error: BaseException | None = None  # what broke a streamed body
        self._waiter: asyncio.Future[None] | None = None  # a Response.read waiting for bytes
        self._got_bytes = False
        self._paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        if self._ready is None or self.complete or self.error is not None:
            self.close()  # bytes no request asked for: this connection is not to be trusted again
            return
        self._got_bytes = True
        self._buf += data
        self._advance(eof=False)

    def eof_received(self) -> bool:
        self._finish_at_close()
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish_at_close(exc)

    # the exchange
    def send(self, request: bytes, *, stream: bool, head_only: bool) -> asyncio.Future[Reply | Head]:
        assert self.transport is not None and self._ready is None
        self._buf.clear()
        self.body.clear()
        self._head = None
        self._framing, self._left, self._chunk = _NO_BODY, 0, _CHUNK_SIZE
        self.complete = False
        self.error = None
        self._got_bytes = False
        self._stream, self._head_only = stream, head_only
        self._ready = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._ready

    def reusable(self) -> bool:
        """Whether the reply was read to its end and left the connection ready for another request."""
        return not self.closed and self.complete and self.error is None and not self._buf

    def reset(self) -> None:
        self._ready = None
        self.body.clear()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def wait(self) -> asyncio.Future[None]:
        """A future set when more of a streamed body is in, or it ended or broke."""
        assert self._waiter is None or self._waiter.done()
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def taken(self) -> None:
        """The reader took the body bytes: read from the socket again if it was paused."""
        if self._paused and self.transport is not None and not self.transport.is_closing():
            self._paused = False
            self.transport.resume_reading()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(exc)
        else:
            self.error = exc
            self._wake()
        self.close()

    def _finish_at_close(self, exc: Exception | None = None) -> None:
        self.closed = True
        if self._ready is None or self.complete or self.error is not None:
            return
        self._advance(eof=True)
        if self.complete or self.error is not None:
            return
        if not self._got_bytes:
            self._fail(ClosedBeforeReply("the server closed the connection before replying"))
        else:
            reason = f": {exc!r}" if exc is not None else ""
            self._fail(ConnectionBroken(f"the connection closed mid-reply{reason}"))

    def _advance(self, eof: bool) -> None:
        """Parse what is in: the head, then the body; resolve or wake whoever waits."""
        assert self._ready is not None
        try:
            if self._head is None:
                self._head = self._parse_head()
                if self._head is None:
                    return
                if self._stream and not self._ready.done():
                    self._ready.set_result(self._head)
            self._decode_body(eof)
        except ProtocolError as exc:
            self._fail(exc)
            return
        if not self._stream:
            if self.complete and not self._ready.done():
                self._ready.set_result(Reply(self._head.status, self._head.headers, bytes(self.body)))
            elif len(self.body) > _MAX_BODY:
                self._fail(ProtocolError("reply body over the client's bound"))
            return
        if self.body or self.complete:
            self._wake()
        transport = self.transport
        if len(self.body) >= _STREAM_HIGH_WATER and not self._paused and transport and not transport.is_closing():
            self._paused = True
            transport.pause_reading()

    def _parse_head(self) -> Head | None:
        """The head, once it is in (interim 1xx answers skipped), its body's framing set."""
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > _MAX_HEAD:
                    raise ProtocolError("reply headers over 64 KiB")
                return None
            lines = self._buf[:end].decode("latin-1").split("\r\n")
            del self._buf[: end + 4]
            status = _status(lines[0])
            raw: list[tuple[str, str]] = []
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep or not name or name != name.strip():
                    raise ProtocolError(f"bad header line {line[:80]!r}")
                raw.append((name, value.strip()))
            if not 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
                break
        headers = {name.lower(): value for name, value in raw}
        if self._head_only or status in (204, 304):
            self._framing = _NO_BODY
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing = _CHUNKED
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit() or (not self._stream and int(length) > _MAX_BODY):
                raise ProtocolError(f"bad Content-Length {length[:40]!r}")
            self._framing, self._left = _LENGTH, int(length)
        else:
            self._framing = _UNTIL_CLOSE  # delimited by the close: the connection is spent
            self.closed = True
        if headers.get("connection", "").lower() == "close":
            self.closed = True  # read to its end, but never reused
        return Head(status, headers, tuple(raw))

    def _decode_body(self, eof: bool) -> None:
        """Move the body bytes in ``self._buf`` to ``self.body``, framing removed; mark the end."""
        buf = self._buf
        if self._framing == _NO_BODY:
            self.complete = True
        elif self._framing == _LENGTH:
            n = min(self._left, len(buf))
            if n:
                self.body += buf[:n]
                del buf[:n]
                self._left -= n
            self.complete = self._left == 0
        elif self._framing == _UNTIL_CLOSE:
            self.body += buf
            buf.clear()
            self.complete = eof
        else:
            self._dechunk()

    def _dechunk(self) -> None:
        buf = self._buf
        while True:
            if self._chunk == _CHUNK_SIZE:
                eol = buf.find(b"\r\n")
                if eol < 0:
                    if len(buf) > _MAX_HEAD:
                        raise ProtocolError("chunk-size line over 64 KiB")
                    return
                size_text = bytes(buf[:eol]).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {size_text[:20]!r}") from None
                if size < 0:
                    raise ProtocolError(f"bad chunk size {size_text[:20]!r}")
                del buf[: eol + 2]
                self._chunk, self._left = (_CHUNK_DATA, size) if size else (_CHUNK_TRAILERS, 0)
            elif self._chunk == _CHUNK_DATA:
                n = min(self._left, len(buf))
                if n == 0:
                    return
                self.body += buf[:n]
                del buf[:n]
                self._left -= n
                if self._left == 0:
                    self._chunk = _CHUNK_CRLF
            elif self._chunk == _CHUNK_CRLF:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                del buf[:2]
                self._chunk = _CHUNK_SIZE
            else:  # the last chunk came: trailers (if any), then an empty line
                end = 0 if buf[:2] == b"\r\n" else buf.find(b"\r\n\r\n")
                if end < 0 or (end == 0 and len(buf) < 2):
                    if len(buf) > _MAX_HEAD:
                        raise ProtocolError("trailers over 64 KiB")
                    return
                del buf[: end + (2 if end == 0 else 4)]
                self.complete = True
                return


def _status(line: str) -> int:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ProtocolError(f"bad status line {line[:80]!r}")
    return int(code)


class Response:
    """A reply whose head is in and whose body is read as it arrives (:meth:`read`).

    :meth:`close` must follow, whatever happens: a reply read to its end gives its connection back
    to the client's pool; any other is closed, so the server sees the request abandoned.
    """

    __slots__ = ("_client", "_conn", "_hostport", "head")

    def __init__(self, client: Http1Client, hostport: str, conn: _Exchange, head: Head) -> None:
        self._client, self._hostport, self._conn = client, hostport, conn
        self.head = head

    @property
    def status(self) -> int:
        return self.head.status

    async def read(self, timeout_s: float) -> bytes:
        """The body bytes that came since the last call (waiting up to ``timeout_s`` for some),
        b"" at the end of the body. Raises TimeoutError when none came in time, and an
        :class:`Http1Error` when the connection broke (after the bytes that came before it)."""
        conn = self._conn
        assert conn is not None, "read after close"
        while True:
            if conn.body:
                data = bytes(conn.body)
                conn.body.clear()
                conn.taken()
                return data
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return b""
            waiter = conn.wait()
            timer = asyncio.get_running_loop().call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.reusable() and not conn.body:
            self._client._release(self._hostport, conn)
        else:
            conn.close()  # mid-body: the server must see the request abandoned


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Http1Client:
    """Kept-alive HTTP/1.1 connections per host:port.

    :meth:`request` and :meth:`open` raise :class:`ConnectFailed` when a connection cannot be
    made, TimeoutError when that takes over ``connect_timeout_s`` (the caller bounds the whole
    exchange), and another :class:`Http1Error` when the exchange breaks. A kept-alive connection
    that the server closed before replying (an idle timeout racing the request) is retried once on
    a new one; never once a byte of the reply came.
    """

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.connections_made = 0  # every connection this client opened, the first to each host included
        self._idle: dict[str, list[_Exchange]] = {}

    async def request(
        self, method: str, hostport: str, target: str, body: bytes | None, headers: Iterable[tuple[str, str]]
    ) -> Reply:
        """Send a request and read its whole reply."""
        return await self.send(hostport, encode_request(method, hostport, target, body, headers), method == "HEAD")

    async def send(self, hostport: str, request: bytes, head_only: bool = False) -> Reply:
        """Send a request encoded already (:func:`encode_request`: a load generator encodes each
        request once and sends it many times) and read its whole reply; ``head_only`` for a HEAD."""
        conn, reply = await self._exchange(hostport, request, False, head_only)
        assert isinstance(reply, Reply)
        if conn.reusable():
            self._release(hostport, conn)
        else:
            conn.close()
        return reply

    async def open(
        self, method: str, hostport: str, target: str, body: bytes | None, headers: Iterable[tuple[str, str]]
    ) -> Response:
        """Send a request and return once the reply's head is in; the caller reads and closes it."""
        request = encode_request(method, hostport, target, body, headers)
        conn, head = await self._exchange(hostport, request, True, method == "HEAD")
        assert isinstance(head, Head)
        return Response(self, hostport, conn, head)

    async def connect(self, hostport: str) -> None:
        """Open a connection to ``hostport`` now and keep it for the next request (whose time then
        holds no handshake)."""
        self._release(hostport, await self._connect(hostport))

    def idle(self, hostport: str) -> int:
        """How many kept-alive connections to ``hostport`` are open, waiting for a request (one
        the server closed meanwhile is not)."""
        return sum(1 for conn in self._idle.get(hostport, ()) if not conn.closed)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def _exchange(
        self, hostport: str, request: bytes, stream: bool, head_only: bool
    ) -> tuple[_Exchange, Reply | Head]:
        conn = self._take(hostport)
        if conn is not None:
            # Closed while idle: the request never reached it; once more on a new connection.
            with contextlib.suppress(ClosedBeforeReply):
                return conn, await self._start(conn, request, stream, head_only)
        conn = await self._connect(hostport)
        return conn, await self._start(conn, request, stream, head_only)

    @staticmethod
    async def _start(conn: _Exchange, request: bytes, stream: bool, head_only: bool) -> Reply | Head:
        try:
            return await conn.send(request, stream=stream, head_only=head_only)
        except BaseException:
            conn.close()  # cancelled or broken mid-exchange: its next bytes belong to no one
            raise

    def _release(self, hostport: str, conn: _Exchange) -> None:
        conn.reset()
        idle = self._idle.setdefault(hostport, [])
        if len(idle) < _IDLE_PER_HOST:
            idle.append(conn)
        else:
            conn.close()

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
        self.connections_made += 1
        return conn


def encode_request(
    method: str, hostport: str, target: str, body: bytes | None, headers: Iterable[tuple[str, str]]
) -> bytes:
    """The request as one buffer: Host and (with a body) Content-Length set here, not by the caller."""
    head = [f"{method} {target} HTTP/1.1", f"Host: {hostport}"]
    if body is not None:
        head.append(f"Content-Length: {len(body)}")
    for name, value in headers:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        head.append(f"{name}: {value}")
    # Header text as aiohttp's server decoded it (UTF-8, surrogateescape): the bytes the client sent.
    encoded = ("\r\n".join(head) + "\r\n\r\n").encode("utf-8", "surrogateescape")
    return encoded if body is None else encoded + body
