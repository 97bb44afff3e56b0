"""Minimal HTTP/1.1 server on asyncio + httptools.

Starlette/uvicorn cost several times more CPU per request than this, and the emulator must not be what limits a
gateway benchmark. Supports keep-alive, pipelining (requests on one connection are answered in order), chunked
streaming, disconnect detection and protocol upgrade (used by the KV channel).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl

import httptools

Handler = Callable[["Request"], Awaitable[None]]
UpgradeHandler = Callable[["Request", asyncio.Transport, bytes], asyncio.Protocol | None]

_REASONS = {
    101: b"Switching Protocols", 200: b"OK", 206: b"Partial Content", 400: b"Bad Request", 404: b"Not Found",
    405: b"Method Not Allowed", 408: b"Request Timeout", 429: b"Too Many Requests",
    500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
}
JSON = b"application/json"
TEXT = b"text/plain; charset=utf-8"
SSE = b"text/event-stream; charset=utf-8"


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))


class Request:
    """One parsed request; the handler answers through `respond` or `start_stream`/`send_chunk`/`end_stream`."""

    __slots__ = (
        "_body_parts",
        "body",
        "conn",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query_string",
        "responded",
    )

    def __init__(self, conn: HttpConnection, method: str, url: bytes, keep_alive: bool) -> None:
        self.conn = conn
        self.method = method
        path, _, qs = url.partition(b"?")
        self.path = path.decode("latin-1")
        self.query_string = qs.decode("latin-1")
        self.headers: dict[str, str] = {}
        self.body = b""
        self.keep_alive = keep_alive
        self.responded = False
        self._body_parts: list[bytes] = []

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(self.query_string))

    @property
    def disconnected(self) -> bool:
        return self.conn.closed_at is not None

    def respond(self, status: int, body: bytes = b"", content_type: bytes = JSON,
                headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        if self.responded:
            return
        self.responded = True
        extra = b"".join(b"%s: %s\r\n" % h for h in headers)
        conn_hdr = b"" if self.keep_alive else b"connection: close\r\n"
        self.conn.write(b"%scontent-type: %s\r\ncontent-length: %d\r\n%s%s\r\n%s" % (
            _status_line(status), content_type, len(body), extra, conn_hdr, body))
        if not self.keep_alive:
            self.conn.close()

    def start_stream(self, status: int = 200, content_type: bytes = SSE) -> None:
        self.responded = True
        self.conn.write(b"%scontent-type: %s\r\ntransfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n" % (
            _status_line(status), content_type))

    def send_chunk(self, data: bytes) -> bool:
        """Write one chunk; False when the client has gone (the write failed, as Starlette would notice)."""
        if self.conn.closed_at is not None:
            return False
        self.conn.write(b"%x\r\n%s\r\n" % (len(data), data))
        return True

    def end_stream(self) -> None:
        if self.conn.closed_at is None:
            self.conn.write(b"0\r\n\r\n")
            if not self.keep_alive:
                self.conn.close()

    async def wait_closed(self) -> None:
        await self.conn.wait_closed()


class HttpConnection(asyncio.Protocol):
    __slots__ = (
        "_busy",
        "_closed",
        "_cur",
        "_hdrs",
        "_queue",
        "_runner",
        "_url",
        "closed_at",
        "on_lost",
        "parser",
        "server",
        "transport",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed_at: float | None = None
        self.on_lost: Callable[[], None] | None = None  # set by a handler that must react to the client leaving
        self._closed: asyncio.Future[None] | None = None
        self._queue: deque[Request] = deque()
        self._busy = False
        self._runner: asyncio.Future[None] | None = None
        self._cur: Request | None = None
        self._url = b""
        self._hdrs: dict[str, str] = {}

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed_at = time.time()
        self.server.connections.discard(self)
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        if self.on_lost is not None:
            self.on_lost()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self._upgrade(data[e.args[0]:] if e.args else b"")
        except httptools.HttpParserError:
            self.write(_status_line(400) + b"content-length: 0\r\nconnection: close\r\n\r\n")
            self.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._hdrs[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_message_begin(self) -> None:
        self._url = b""
        self._hdrs = {}

    def on_headers_complete(self) -> None:
        p = self.parser
        self._cur = Request(self, p.get_method().decode(), self._url, p.should_keep_alive())
        self._cur.headers = self._hdrs

    def on_body(self, body: bytes) -> None:
        assert self._cur is not None
        self._cur._body_parts.append(body)

    def on_message_complete(self) -> None:
        req = self._cur
        assert req is not None
        self._cur = None
        parts = req._body_parts
        req.body = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.parser.should_upgrade():
            self._queue.append(req)  # handled in _upgrade once httptools raises
            return
        if self._busy:
            self._queue.append(req)
        else:
            self._busy = True
            self._runner = asyncio.ensure_future(self._run(req))  # one at a time per connection; kept from GC

    # internals
    async def _run(self, req: Request) -> None:
        while True:
            try:
                await self.server.dispatch(req)
            except Exception as e:  # a handler bug must not kill the connection silently
                self.server.log_error(req, e)
                req.respond(500, b'{"object":"error","message":"internal emulator error","type":"500",'
                                 b'"param":null,"code":500}')
            if not self._queue or self.closed_at is not None:
                self._busy = False
                return
            req = self._queue.popleft()

    def _upgrade(self, rest: bytes) -> None:
        req = self._queue.pop() if self._queue else None
        handler = self.server.upgrade_handler
        if req is None or handler is None or self.transport is None:
            self.close()
            return
        proto = handler(req, self.transport, rest)
        if proto is None:
            return  # the handler answered with an error status
        self.server.connections.discard(self)
        self.transport.set_protocol(proto)
        proto.connection_made(self.transport)
        if rest:
            proto.data_received(rest)

    # for Request
    def write(self, data: bytes) -> None:
        if self.transport is not None and self.closed_at is None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the TCP connection without a response (fault injection)."""
        if self.transport is not None:
            self.transport.abort()

    async def wait_closed(self) -> None:
        if self.closed_at is not None:
            return
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
        await self._closed


class HttpServer:
    """Routes by exact (method, path); unknown paths get FastAPI's 404 body."""

    def __init__(self, routes: dict[tuple[str, str], Handler], upgrade_handler: UpgradeHandler | None = None,
                 on_error: Callable[[Request, Exception], None] | None = None) -> None:
        self.routes = routes
        self.upgrade_handler = upgrade_handler
        self.connections: set[HttpConnection] = set()
        self._on_error = on_error
        self._server: asyncio.AbstractServer | None = None

    async def dispatch(self, req: Request) -> None:
        handler = self.routes.get((req.method, req.path))
        if handler is None:
            if any(p == req.path for _, p in self.routes):
                req.respond(405, b'{"detail":"Method Not Allowed"}')
            else:
                req.respond(404, b'{"detail":"Not Found"}')
            return
        await handler(req)

    def log_error(self, req: Request, e: Exception) -> None:
        if self._on_error is not None:
            self._on_error(req, e)

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: HttpConnection(self), host, port, reuse_address=True,
                                                backlog=1024)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.close()
