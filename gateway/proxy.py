"""The generate endpoints as raw ASGI apps: read the body (capped), admit, dispatch, relay.

Raw ASGI rather than a Starlette request/response endpoint because the gateway must notice a client disconnect in
every phase, including the wait before the first byte of a non-streaming response, where Starlette listens for
nothing. A watcher task reads `http.disconnect` and hands the exchange over to `PDExchange.disconnect()`.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from gateway.admission.requests import Route, parse_request
from gateway.assemble import assemble
from gateway.errors import GatewayError
from gateway.lifecycle import CLIENT_GONE, DONE, Failure, PDExchange
from routing.pools import NoWorkerAvailable

if TYPE_CHECKING:
    from gateway.runtime import Gateway

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_DONE_EVENT = b"data: [DONE]\n\n"


class BodyTooLarge(GatewayError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the gateway's limit of {limit} bytes", code="body_too_large")


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, refusing with 413 as soon as it is known to exceed `limit` (before reading it all)."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def tenant_of(scope: Scope) -> str:
    """The client's identity for per-tenant state: its API key's hash, else its address."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return "key:" + hashlib.sha256(value).hexdigest()[:32]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    all_headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode()), *(headers or ())]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: GatewayError) -> None:
    await send_json(send, error.status, error.json())


class GenerateEndpoint:
    """`POST /generate`, `/v1/completions` or `/v1/chat/completions`."""

    def __init__(self, route: Route, gateway: Gateway) -> None:
        self.route = route
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await send_error(send, GatewayError(405, f"{self.route} accepts POST only"))
            return
        gateway = self.gateway
        try:
            raw = await read_body(scope, receive, gateway.config.max_body_bytes)
            request = parse_request(self.route, raw)
            model = gateway.model_for(request.model)
            admitted = await model.admission.admit(request, tenant=tenant_of(scope))
            pair = model.pool.pick_pair()
        except ConnectionAbortedError:
            return
        except NoWorkerAvailable as exc:
            await send_error(send, GatewayError(503, str(exc), code="no_worker_available"))
            return
        except GatewayError as error:
            await send_error(send, error)
            return
        exchange = gateway.dispatch(pair, admitted)
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, exchange))
        try:
            if request.stream:
                await _relay_stream(exchange, send)
            else:
                await _relay_whole(exchange, send)
        finally:
            watcher.cancel()


def _count_header(exchange: PDExchange) -> list[tuple[bytes, bytes]]:
    """The gateway's own prompt count, so a client (and the parity test) can compare it with the engine's usage."""
    return [(b"x-kvgate-prompt-tokens", str(exchange.admitted.prompt_tokens).encode())]


async def _watch_disconnect(receive: Receive, exchange: PDExchange) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    exchange.disconnect()


def _drain(queue: asyncio.Queue[Any], first: Any) -> tuple[list[bytes], Any]:
    """`first` and every payload already queued behind it, plus the marker that ended the run (or None)."""
    payloads = [first]
    while not queue.empty():
        item = queue.get_nowait()
        if not isinstance(item, bytes):
            return payloads, item
        payloads.append(item)
    return payloads, None


async def _relay_stream(exchange: PDExchange, send: Send) -> None:
    queue = exchange.events
    item = await queue.get()
    if item is CLIENT_GONE:
        return
    if isinstance(item, Failure):
        # Nothing was sent yet, so the failure keeps its own status code.
        await send_error(send, item.error)
        return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + _count_header(exchange)})
    while True:
        payloads, marker = _drain(queue, item)
        body = b"".join(b"data: " + p + b"\n\n" for p in payloads)
        if marker is None:
            await send({"type": "http.response.body", "body": body, "more_body": True})
            item = await queue.get()
            if isinstance(item, bytes):
                continue
            marker, body = item, b""
        await _end_stream(exchange, send, body, marker)
        return


async def _end_stream(exchange: PDExchange, send: Send, body: bytes, marker: Any) -> None:
    if marker is CLIENT_GONE:
        return
    if marker is DONE and await exchange.prefill_ok:
        tail = _DONE_EVENT
    else:
        # A stream that already started cannot change its status: it ends with an error event and no [DONE].
        failure = exchange.failure
        tail = failure.error.sse_event() if failure else GatewayError(502, "request failed").sse_event()
    await send({"type": "http.response.body", "body": body + tail, "more_body": False})


async def _relay_whole(exchange: PDExchange, send: Send) -> None:
    queue = exchange.events
    events: list[bytes] = []
    while True:
        item = await queue.get()
        if isinstance(item, bytes):
            payloads, marker = _drain(queue, item)
            events.extend(payloads)
            if marker is None:
                continue
            item = marker
        break
    if item is CLIENT_GONE:
        return
    if item is DONE and await exchange.prefill_ok:
        body = assemble(exchange.admitted.request.route, events)
        await send_json(send, 200, body, _count_header(exchange))
        return
    failure = exchange.failure
    await send_error(send, failure.error if failure else GatewayError(502, "request failed"))
