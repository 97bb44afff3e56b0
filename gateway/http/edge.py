"""The generate routes served straight from kvgate's HTTP protocol: no ASGI scope, message dicts, per-receive events
or disconnect-watching task per request, and a whole answer leaves in one write (head and body together).

`EdgeCycle` takes the place of uvicorn's `RequestResponseCycle` for one request on a connection: the protocol feeds
it the body (`body`, `more_body`, `message_event`), marks it `disconnected` when the connection is lost, queues it
behind a pipelined predecessor and runs it as its task (`run_asgi`), as it does uvicorn's own cycle; the edge guards
(header and body caps, head and body timers, connection shares) all stay in the protocol, before a cycle exists.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from uvicorn.protocols.http.flow_control import FlowControl

from gateway.http.client_link import Headers
from gateway.http.intake import request_id_of

log = logging.getLogger("kvgate.http")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_STATUS_LINES = {status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode())
                 for status in http.HTTPStatus}
_FAILED = (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain; charset=utf-8\r\n"
           b"content-length: 21\r\nconnection: close\r\nx-request-id: %s\r\n\r\nInternal Server Error")


class EdgeEndpoint(Protocol):
    def serve(self, link: EdgeCycle) -> Awaitable[None]: ...


class EdgeCycle:
    """One generate request and its answer on a keep-alive HTTP/1.1 connection (a `ClientLink`)."""

    __slots__ = ("_chunked", "_endpoint", "_head", "_on_disconnect", "_on_response", "_transport",
                 "body", "client", "default_headers", "disconnected", "flow", "headers", "keep_alive",
                 "message_event", "method", "more_body", "response_complete", "response_started",
                 "waiting_for_100_continue")

    def __init__(self, endpoint: EdgeEndpoint, *, transport: asyncio.Transport, flow: FlowControl,
                 headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None, keep_alive: bool,
                 expect_100_continue: bool, default_headers: list[tuple[bytes, bytes]],
                 on_response: Callable[[], None]) -> None:
        self._endpoint = endpoint
        self._transport = transport
        self.flow = flow
        self.method = "POST"
        self.headers = headers
        self.client = client
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.default_headers = default_headers
        self._on_response = on_response
        # Fed by the protocol, as uvicorn's cycle is.
        self.body = bytearray()
        self.more_body = True
        self.message_event = asyncio.Event()
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self._head = b""  # the response head, written with the first body part
        self._chunked = False
        self._on_disconnect: Callable[[], None] | None = None

    async def run_asgi(self, _app: Any) -> None:
        """The protocol's name for running a cycle (its app is not used: the endpoint is this cycle's own)."""
        try:
            await self._endpoint.serve(self)
        except BaseException as exc:
            log.error("generate request failed in the gateway", exc_info=exc)
            self._fail()
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            if not self.response_complete and not self.disconnected:
                log.error("generate request returned without completing its answer")
                self._fail()
        finally:
            self._on_response = _nothing
            self._on_disconnect = None

    def _fail(self) -> None:
        """A 500 while no byte of the answer is out (its head is kept for the first body part: a head taken but not
        sent is no answer yet), then the connection is closed (a started answer is cut short, never completed)."""
        if (not self.response_started or self._head) and not self._transport.is_closing():
            self._transport.write(_FAILED % request_id_of(self.headers))
            self._head = b""
        self._transport.close()

    # ── the request ─────────────────────────────────────────────────────────────────────────────────────────
    async def receive(self) -> tuple[bytes, bool]:
        if self.waiting_for_100_continue and not self._transport.is_closing():
            self._transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            if not self.message_event.is_set():  # (a body already whole: no coroutine to wait on)
                await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            raise ConnectionAbortedError
        chunk, self.body = bytes(self.body), bytearray()
        return chunk, self.more_body

    @property
    def body_complete(self) -> bool:
        return not self.more_body

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        self._on_disconnect = callback
        if callback is not None and self.disconnected and not self.response_complete:
            self._on_disconnect = None
            callback()

    def connection_lost(self) -> None:
        """Called by the protocol once the connection is gone (after it set `disconnected`)."""
        callback, self._on_disconnect = self._on_disconnect, None
        if callback is not None and self.disconnected:
            callback()

    # ── the answer ──────────────────────────────────────────────────────────────────────────────────────────
    async def write_head(self, status: int, headers: Headers) -> None:
        """The head, kept to go out with the first body part. The headers are kvgate's own (the one value a client
        chose, its x-request-id, was checked against a strict pattern on the way in)."""
        if self.response_started:
            raise RuntimeError("the response head was already written")
        self.response_started = True
        if self.waiting_for_100_continue and self.more_body:
            # Answered before the client was told to send its body: it will not send it (RFC 9110 10.1.1), so
            # what it sends next would be read as that body. Closed after this answer instead.
            self.keep_alive = False
        self.waiting_for_100_continue = False
        parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        chunked = True
        for name, value in (*self.default_headers, *headers):
            if name == b"content-length":
                chunked = False
            elif name == b"connection" and value == b"close":
                self.keep_alive = False
            parts.append(b"%s: %s\r\n" % (name, value))
        if not self.keep_alive and (b"connection", b"close") not in headers:
            parts.append(b"connection: close\r\n")
        if chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        parts.append(b"\r\n")
        self._chunked = chunked
        self._head = b"".join(parts)

    async def write_body(self, data: bytes, *, more: bool) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected or self.response_complete:
            return
        if self._chunked:
            framed = b"%s%x\r\n%s\r\n" % (self._head, len(data), data) if data else self._head
            out = framed if more else framed + b"0\r\n\r\n"
        else:
            out = self._head + data if self._head else data
        self._head = b""
        self._transport.write(out)
        if not more:
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self._transport.close()
            self._on_response()


def _nothing() -> None:
    pass
