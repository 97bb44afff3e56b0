"""The generate endpoints as raw ASGI apps: read the body (capped, timed), admit, dispatch, relay.

Raw ASGI rather than a Starlette request/response endpoint because the gateway must notice a client disconnect in
every phase, including the wait before the first byte of a non-streaming response, where Starlette listens for
nothing. A watcher task reads `http.disconnect` and hands the exchange over to `PDExchange.disconnect()`.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING

from starlette.types import Message, Receive, Scope, Send

from gateway.admission.requests import Route, UsageOptions
from gateway.assemble import assembler_for
from gateway.body import RequestBody
from gateway.errors import GatewayError
from gateway.intake import CLOSE, Headers, Refused, identify, receive_body, retry_after, throttle
from gateway.lifecycle import ClientGone, Done, Failure, PDExchange
from gateway.probe import is_probe
from gateway.telemetry.record import RequestRecord
from gateway.tenancy.errors import RateLimited, StateDown
from gateway.tenancy.tenants import CANARY
from routing.pools import NoWorkerAvailable, PoolSaturated

if TYPE_CHECKING:
    from gateway.runtime import Gateway

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_DONE_EVENT = b"data: [DONE]\n\n"
# A usage object inside an OpenAI stream chunk (one level of nesting: prompt_tokens_details).
_ANSWER_KEPT = 1 << 18  # bytes of a sampled answer kept for the provenance check
_USAGE = re.compile(rb',"usage":\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}')


async def send_json(send: Send, status: int, body: bytes, headers: Headers = ()) -> None:
    all_headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: GatewayError, headers: Headers = ()) -> None:
    await send_json(send, error.status, error.json(), headers)


class GenerateEndpoint:
    """`POST /generate`, `/v1/completions` or `/v1/chat/completions`."""

    def __init__(self, route: Route, gateway: Gateway) -> None:
        self.route = route
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = RequestRecord(self.route, probe=is_probe(scope))
        if "kvgate.request_id" in scope:
            record.request_id = scope["kvgate.request_id"]
        if not record.probe:
            self.gateway.tracing.start_request(record, scope["headers"])

        async def observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif record.sampled and len(record.answer) < _ANSWER_KEPT:
                record.answer += message.get("body", b"")[: _ANSWER_KEPT - len(record.answer)]
            await send(message)

        try:
            await self._serve(scope, receive, observed, record)
        finally:
            self.gateway.observe_request(record)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, record: RequestRecord) -> None:
        if scope["method"] != "POST":
            await send_error(send, GatewayError(405, f"{self.route} accepts POST only"))
            return
        if self.gateway.shutting_down:
            await self._refuse(send, record, GatewayError(503, "the gateway is shutting down", code="shutting_down"),
                               [*CLOSE, (b"retry-after", b"1")])
            return
        if self.gateway.fleet.closed:
            await self._refuse(send, record, StateDown(), [(b"retry-after", b"1")])
            return
        with RequestBody() as body:
            exchange = await self._admit(scope, receive, send, body, record)
        if exchange is None:
            return
        record.exchange = exchange
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, exchange))
        try:
            if exchange.admitted.stream:
                await _relay_stream(exchange, send)
            else:
                await _relay_whole(exchange, send)
        finally:
            watcher.cancel()

    async def _admit(self, scope: Scope, receive: Receive, send: Send, body: RequestBody,
                     record: RequestRecord) -> PDExchange | None:
        """Read, count and check the request, and dispatch it; or answer the error and return None."""
        gateway = self.gateway
        try:
            tenant = CANARY if record.probe else await identify(gateway, scope)
            record.tenant = tenant.name
            throttle(gateway, tenant)
            await receive_body(gateway, scope, receive, body)
        except Refused as refused:
            await self._refuse(send, record, refused.error, refused.headers)
            return None
        except ConnectionAbortedError:
            return None
        try:
            started = time.perf_counter()
            model, admitted = await gateway.admit(self.route, body, tenant=tenant.name)
            record.model = model.name
            record.admitted = admitted
            record.sampled = gateway.samples_provenance(model) and not record.probe  # the canary is not a tenant
            record.admission_s = time.perf_counter() - started
            tenant_pass = await gateway.fleet.limiter.admit(tenant, admitted.most_prompt_tokens)
        except (RateLimited, StateDown) as error:
            await self._refuse(send, record, error, retry_after(error))
            return None
        except GatewayError as error:
            await self._refuse(send, record, error)
            return None
        salt = gateway.fleet.salts.salt(tenant.salt_group, admitted.cache_salt)
        key = model.route_key(admitted, scope["headers"], salt)
        request_id = record.request_id or ""
        gateway.queue_begin(request_id)
        try:
            started = time.perf_counter()
            lease = await model.pool.acquire_pair(key)
            record.queue_s = time.perf_counter() - started
        except NoWorkerAvailable as exc:
            gateway.queue_end(request_id, dispatched=False)
            tenant_pass.release()
            await self._refuse(send, record, GatewayError(503, exc.public_message, code="no_worker_available",
                                                          detail=str(exc)))
            return None
        except PoolSaturated as exc:
            gateway.queue_end(request_id, dispatched=False)
            tenant_pass.release()
            await self._refuse(send, record, GatewayError(503, str(exc), code="overloaded"),
                               [(b"retry-after", str(exc.retry_after_s).encode())])
            return None
        except BaseException:  # e.g. cancelled while queued
            gateway.queue_end(request_id, dispatched=False)
            tenant_pass.release()
            raise
        refusal = None
        if gateway.queue_end(request_id, dispatched=model.refusal is None):
            refusal = GatewayError(503, "the request was aborted by an operator", code="aborted_by_operator")
        elif model.refusal is not None:  # disabled (or refused by the gate) while it waited in the queue
            refusal = GatewayError(503, f"model {model.name!r} is not served: {model.refusal}",
                                   code="model_unavailable", detail=model.unavailable)
        if refusal is not None:
            lease.release()
            tenant_pass.release()
            await self._refuse(send, record, refusal)
            return None
        return gateway.dispatch(model, lease, admitted, key, traceparent=record.engine_traceparent,
                                request_id=record.request_id, tenant_pass=tenant_pass, cache_salt=salt)

    @staticmethod
    async def _refuse(send: Send, record: RequestRecord, error: GatewayError, headers: Headers = ()) -> None:
        """Answer an error before any engine saw the request."""
        record.refused = error
        await send_error(send, error, headers)


def _count_header(exchange: PDExchange) -> list[tuple[bytes, bytes]]:
    """The gateway's own prompt count, so a client (and the parity test) can compare it with the engine's usage."""
    return [(b"x-kvgate-prompt-tokens", str(exchange.prompt_tokens).encode())]


async def _watch_disconnect(receive: Receive, exchange: PDExchange) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    exchange.disconnect()


def _presented(payload: bytes, usage: UsageOptions | None) -> bytes | None:
    """A decode event as the client asked for it: the gateway always asks decode for usage in every OpenAI chunk
    (to verify its count before release); a client that did not ask gets it stripped, or the chunk dropped."""
    if usage is None or b'"usage":{' not in payload:
        return payload
    if b'"choices":[]' in payload:  # the final usage-only chunk
        return payload if usage.include_usage else None
    return payload if usage.continuous else _USAGE.sub(b',"usage":null', payload)


async def _relay_stream(exchange: PDExchange, send: Send) -> None:
    queue = exchange.events
    usage = exchange.admitted.usage if exchange.admitted.route != "/generate" else None
    event = await queue.get()
    match event:
        case ClientGone():
            return
        case Failure(error):
            # Nothing was sent yet, so the failure keeps its own status code.
            await send_error(send, error, retry_after(error))
            return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + _count_header(exchange)})
    while True:
        parts: list[bytes] = []
        while isinstance(event, bytes):
            shown = _presented(event, usage)
            if shown is not None:
                parts.append(b"data: " + shown + b"\n\n")
            event = queue.get_nowait() if not queue.empty() else None
        body = b"".join(parts)
        match event:
            case None:
                await send({"type": "http.response.body", "body": body, "more_body": True})
                event = await queue.get()
            case Done():
                await send({"type": "http.response.body", "body": body + _DONE_EVENT, "more_body": False})
                return
            case Failure(error):
                # A stream that already started cannot change its status: an error event and no [DONE].
                await send({"type": "http.response.body", "body": body + error.sse_event(), "more_body": False})
                return
            case ClientGone():
                return


async def _relay_whole(exchange: PDExchange, send: Send) -> None:
    assembler = assembler_for(exchange.admitted.route)
    broken: GatewayError | None = None
    while True:
        match await exchange.events.get():
            case bytes() as payload:
                if broken is not None:
                    continue
                try:
                    assembler.add(payload)
                except (ValueError, TypeError, AttributeError):  # orjson's decode error is a ValueError
                    broken = GatewayError(502, "the decode engine sent an event that is not a valid chunk",
                                          code="decode_failed")
                    exchange.fail(broken)
            case Done():
                # The bad chunk may have been queued together with Done (released in one step): still an error.
                if broken is not None:
                    await send_error(send, broken)
                else:
                    await send_json(send, 200, assembler.body(), _count_header(exchange))
                return
            case Failure(error):
                await send_error(send, error, retry_after(error))
                return
            case ClientGone():
                return
