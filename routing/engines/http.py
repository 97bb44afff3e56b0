"""A small HTTP/1.1 client for engine traffic: keep-alive connections per engine address, httptools parsing.

Written for two needs no maintained client meets: every new connection is handed to a hook before its first
request (the gateway checks, on that very connection, that the engine is the one the KV-pool gate verified, so a
restarted engine gets nothing until it is judged again), and the hot path stays within a few tens of microseconds
per request. Parsing, chunked decoding and keep-alive rules are httptools' (llhttp).

Errors raised here are `HttpError`s; the engine client maps them to its own hierarchy.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import cast

import httptools

# SGLang serves with uvicorn's keep-alive timeout of 5 s: an idle connection older than this may be closing.
IDLE_EXPIRY_S = 4.0
# Unread response bytes above which reading from the socket pauses (the consumer is slower than the engine).
_HIGH_WATER = 1 << 20
_LOW_WATER = 1 << 18
_CHUNK_COST = 64  # bytes a buffered chunk costs beyond its payload (the bytes object, the deque slot)
# Framing (chunk sizes, trailers) may exceed the body it carries by at most this much: an engine's SSE chunks carry far
# more than their few bytes of framing; tiny chunks or an endless trailer are not an engine's answer.
_FRAMING_SLACK = 128 * 1024  # (the head, up to 64 KiB, may share a read with the first body bytes)


class HttpError(Exception):
    """Base of this module's errors."""


class ConnectFailed(HttpError):
    """The TCP connection could not be opened (refused, unreachable, timed out)."""


class ConnectionClosed(HttpError):
    """The connection closed before the response was complete."""


class ProtocolViolation(HttpError):
    """The peer sent bytes that are not a valid HTTP/1.1 response."""


class BodyTooLarge(HttpError):
    """The peer's body is longer than the reader allows."""


# A response head (status line and headers) longer or with more headers than this is no engine's: refused before
# it is buffered whole (an engine that never ends its headers would otherwise grow the gateway without bound).
MAX_RESPONSE_HEAD_BYTES = 64 * 1024
MAX_RESPONSE_HEADERS = 100

NewConnectionHook = Callable[["HttpConnection"], Awaitable[None]]
Body = Sequence[bytes | memoryview]  # a request body in parts, written in order
_COALESCE_BYTES = 64 * 1024


class Response:
    """One response: status and headers once they are in, then the body as it arrives."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_conn",
        "_consumed",
        "_error",
        "_on_finish",
        "_waiter",
        "headers",
        "status",
    )

    def __init__(self, conn: HttpConnection, on_finish: Callable[[HttpConnection, bool], None]) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._error: HttpError | None = None
        self._consumed = False
        self._on_finish = on_finish

    @property
    def complete(self) -> bool:
        return self._complete

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; BodyTooLarge once it passes `max_bytes` (no more of it is kept)."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise BodyTooLarge(f"a body over {max_bytes} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes in the pieces they arrived in; raises ConnectionClosed if the body is cut short."""
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it arrived, None once it has all come; ConnectionClosed if it is cut short."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._take(len(chunk) + _CHUNK_COST)
                return chunk
            if self._complete:
                self._finish(reusable=True)
                return None
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def next_data(self) -> bytes | None:
        """Everything of the body that has arrived and not been taken, in one piece (one chunk at least), None once
        it has all come: a reader that handles bytes, not chunks, pays once for the chunks of one socket read."""
        chunk = await self.next_chunk()
        chunks = self._chunks
        if chunk is None or not chunks:
            return chunk
        parts = [chunk, *chunks]
        chunks.clear()
        joined = b"".join(parts)
        self._take(len(joined) - len(chunk) + (len(parts) - 1) * _CHUNK_COST)
        return joined

    def close(self) -> None:
        """Abandon the response: a connection whose response was not read to its end is closed, not reused."""
        self._finish(reusable=self._complete and not self._chunks)

    # ── fed by the connection ───────────────────────────────────────────────────────────────────────────────
    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk) + _CHUNK_COST
        if self._buffered > _HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _end(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: HttpError) -> None:
        if not self._complete:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _take(self, size: int) -> None:
        before = self._buffered
        self._buffered -= size
        if before > _HIGH_WATER >= self._buffered or (before > _LOW_WATER >= self._buffered):
            self._conn.resume_reading()

    def _finish(self, *, reusable: bool) -> None:
        if not self._consumed:
            self._consumed = True
            self._on_finish(self._conn, reusable)


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection; requests go one at a time."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: Response | None = None
        self._headers_ready: asyncio.Future[None] | None = None
        self._keep_alive = False
        self._reading_paused = False
        self._head_bytes = 0  # of the response whose headers are still coming
        self._header_count = 0
        self._framing = 0  # bytes received for this response beyond its head and body: chunk framing, trailers
        self._body_bytes = 0
        self.closed = False
        self.idle_since = 0.0

    # ── asyncio.Protocol ────────────────────────────────────────────────────────────────────────────────────
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        if self._response is None:
            self._abort(ProtocolViolation("bytes received with no request outstanding"))
            return
        body_before = self._body_bytes
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # a limit of ours, raised in a callback, says why itself
            self._abort(cause if isinstance(cause, ProtocolViolation) else ProtocolViolation(
                f"invalid HTTP response: {exc}"))
            return
        response = self._response
        if response is not None and not response.status:  # its head is still coming
            self._head_bytes += len(data)
            if self._head_bytes > MAX_RESPONSE_HEAD_BYTES:
                self._abort(ProtocolViolation(f"response headers over {MAX_RESPONSE_HEAD_BYTES} bytes"))
        elif response is not None:
            body = self._body_bytes - body_before
            self._framing += len(data) - body
            if self._framing > self._body_bytes + _FRAMING_SLACK:
                self._abort(ProtocolViolation("more framing than body (tiny chunks or endless trailers)"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if exc is None and response is not None and response.status and not response.complete \
                and _delimited_by_close(response.headers):
            response._end()  # HTTP/1.0-style body: it ends where the connection does
        error = ConnectionClosed(f"connection closed by the engine{f': {exc}' if exc else ''}")
        if self._headers_ready is not None and not self._headers_ready.done():
            self._headers_ready.set_exception(error)
        if response is not None:
            response._fail(error)

    # ── httptools callbacks ─────────────────────────────────────────────────────────────────────────────────
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._response is not None
        if self._response.status:
            raise ProtocolViolation("response trailers (no engine sends any)")  # ends the parse
        self._header_count += 1
        if self._header_count > MAX_RESPONSE_HEADERS:
            raise ProtocolViolation(f"more than {MAX_RESPONSE_HEADERS} response headers")  # ends the parse
        self._response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self._response is not None
        self._response.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        if self._headers_ready is not None and not self._headers_ready.done():
            self._headers_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self._response is not None
        self._body_bytes += len(body)
        self._response._feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        assert response is not None
        response._end()

    # ── used by the pool ────────────────────────────────────────────────────────────────────────────────────
    async def send(self, head: bytes, body: Body, on_finish: Callable[[HttpConnection, bool], None]) -> Response:
        """Write a request and wait for the response's status and headers."""
        if self.closed or self._transport is None or self._transport.is_closing():
            raise ConnectionClosed("connection is closed")
        self._parser = httptools.HttpResponseParser(self)
        self._head_bytes = self._header_count = self._framing = self._body_bytes = 0
        response = self._response = Response(self, on_finish)
        self._headers_ready = asyncio.get_running_loop().create_future()
        if _length(body) < _COALESCE_BYTES:
            self._transport.write(b"".join((head, *body)))  # one segment for a small request
        else:
            self._transport.write(head)
            for part in body:  # large parts go out as they are: no copy of a multi-megabyte body
                self._transport.write(part)
        try:
            await self._headers_ready
        except BaseException:
            self._abort(ConnectionClosed("request abandoned before its response"))
            raise
        finally:
            self._headers_ready = None
        return response

    @property
    def reusable(self) -> bool:
        return self._keep_alive and not self.closed and self._transport is not None \
            and not self._transport.is_closing()

    def detach(self) -> None:
        """The exchange on this connection is over; it may carry the next request."""
        self._response = None
        if self._reading_paused:
            self.resume_reading()

    def pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self._transport.is_closing():
            self._reading_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def _abort(self, error: HttpError) -> None:
        if self._headers_ready is not None and not self._headers_ready.done():
            self._headers_ready.set_exception(error)
        if self._response is not None:
            self._response._fail(error)
        self.closed = True
        if self._transport is not None:
            self._transport.abort()


class ConnectionPool:
    """Keep-alive connections to one engine address. `on_new_connection` runs on each new connection before any
    request is sent on it; if it raises, the connection is closed and the error propagates."""

    def __init__(self, host: str, port: int, *, connect_timeout_s: float, tls: ssl.SSLContext | None = None,
                 on_new_connection: NewConnectionHook | None = None) -> None:
        self.host = host
        self.port = port
        self.on_new_connection = on_new_connection
        self._connect_timeout_s = connect_timeout_s
        self._tls = tls
        self._idle: list[HttpConnection] = []
        self._busy: set[HttpConnection] = set()
        self._host_header = f"{host}:{port}".encode()

    async def request(self, method: bytes, path: str, body: Body = (),
                      headers: tuple[tuple[bytes, bytes], ...] = ()) -> Response:
        return await self.send_on(await self.acquire(), method, path, body, headers)

    async def send_on(self, connection: HttpConnection, method: bytes, path: str, body: Body = (),
                      headers: tuple[tuple[bytes, bytes], ...] = ()) -> Response:
        """Send a request on a connection from `acquire()`; it returns to the pool once the response is read."""
        try:
            return await connection.send(self._head(method, path, headers, _length(body)), body, self._finished)
        except BaseException:
            self._busy.discard(connection)
            connection.close()
            raise

    def give_back(self, connection: HttpConnection) -> None:
        """A connection from `acquire()` that was not used after all."""
        self._finished(connection, True)

    async def fetch(self, connection: HttpConnection, path: str, *, max_bytes: int) -> tuple[int, bytes]:
        """A GET on `connection` itself (from a new-connection hook), leaving it ready for the next request."""
        response = await connection.send(self._head(b"GET", path, (), 0), (), _detach)
        body = await response.read(max_bytes)
        if not connection.reusable:
            raise ConnectionClosed("the engine closed the connection after answering")
        return response.status, body

    async def acquire(self) -> HttpConnection:
        """An idle connection still fit for reuse, else a new one that passed the new-connection hook."""
        connection = self.take_idle()
        if connection is not None:
            return connection
        connection = await self._connect()
        self._busy.add(connection)
        if self.on_new_connection is not None:
            try:
                await self.on_new_connection(connection)
            except BaseException:
                self._busy.discard(connection)
                connection.close()
                raise
        return connection

    def take_idle(self) -> HttpConnection | None:
        """An idle connection still fit for reuse, at once; None when there is none."""
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable and now - connection.idle_since < IDLE_EXPIRY_S:
                self._busy.add(connection)
                return connection
            connection.close()
        return None

    def close(self) -> None:
        for connection in [*self._idle, *self._busy]:
            connection.close()
        self._idle.clear()
        self._busy.clear()

    async def _connect(self) -> HttpConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, protocol = await loop.create_connection(HttpConnection, self.host, self.port, ssl=self._tls)
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection within {self._connect_timeout_s:g}s") from exc
        except OSError as exc:
            raise ConnectFailed(exc.strerror or str(exc)) from exc
        return protocol

    def _head(self, method: bytes, path: str, headers: tuple[tuple[bytes, bytes], ...], length: int) -> bytes:
        extra = b"".join(b"%s: %s\r\n" % header for header in headers)
        return b"%s %s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n" % (
            method, path.encode(), self._host_header, extra, length)

    def _finished(self, connection: HttpConnection, reusable: bool) -> None:
        self._busy.discard(connection)
        connection.detach()
        if reusable and connection.reusable:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()


def _length(body: Body) -> int:
    return sum(len(part) for part in body)


def _detach(connection: HttpConnection, reusable: bool) -> None:
    connection.detach()


def _delimited_by_close(headers: list[tuple[bytes, bytes]]) -> bool:
    return not any(name in (b"content-length", b"transfer-encoding") for name, _ in headers)
