"""Decode's released events → the client: an event stream as it comes, or, for a client that does not stream,
decode's own whole answer (the exchange asks decode for one), once it is checked."""

from __future__ import annotations

import re

from gateway.admission.requests import UsageOptions
from gateway.errors import GatewayError
from gateway.http.client_link import ClientLink
from gateway.http.intake import Headers, retry_after
from gateway.pd.events import ClientGone, Done, Failure, RelayEvent
from gateway.pd.exchange import PDExchange
from gateway.telemetry.record import RequestRecord

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_DONE_EVENT = b"data: [DONE]\n\n"
ANSWER_KEPT = 1 << 18  # bytes of a sampled answer kept for the provenance check
# A usage object inside an OpenAI stream chunk (one level of nesting: prompt_tokens_details).
_USAGE = re.compile(rb',"usage":\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}')


class ClientResponse:
    """The generate routes' way out: the client link, with the request's id stamped on the head and what the access
    record needs observed on the way (the status; a sampled answer's first bytes, for the provenance check)."""

    __slots__ = ("_link", "_record", "_request_id")

    def __init__(self, link: ClientLink, request_id: bytes, record: RequestRecord) -> None:
        self._link = link
        self._request_id = request_id
        self._record = record

    async def start(self, status: int, headers: Headers) -> None:
        self._record.status = status
        await self._link.write_head(status, [*headers, (b"x-request-id", self._request_id)])

    async def body(self, data: bytes, *, more: bool = False) -> None:
        record = self._record
        if record.sampled and len(record.answer) < ANSWER_KEPT:
            record.answer += data[: ANSWER_KEPT - len(record.answer)]
        await self._link.write_body(data, more=more)


async def send_json(response: ClientResponse, status: int, body: bytes, headers: Headers = ()) -> None:
    await response.start(status, [*_JSON_HEADERS, (b"content-length", str(len(body)).encode()), *headers])
    await response.body(body)


async def send_error(response: ClientResponse, error: GatewayError, headers: Headers = ()) -> None:
    await send_json(response, error.status, error.json(), headers)


async def relay(exchange: PDExchange, response: ClientResponse) -> None:
    """The exchange's events to the client, as it asked for them."""
    if exchange.admitted.stream:
        await _relay_stream(exchange, response)
    else:
        await _relay_whole(exchange, response)


def _count_header(exchange: PDExchange) -> list[tuple[bytes, bytes]]:
    """The gateway's own prompt count, so a client (and the parity test) can compare it with the engine's usage."""
    return [(b"x-kvgate-prompt-tokens", str(exchange.prompt_tokens).encode())]


def _presented(payload: bytes, usage: UsageOptions | None) -> bytes | None:
    """A decode event as the client asked for it: the gateway always asks decode for usage in every OpenAI chunk
    (to verify its count before release); a client that did not ask gets it stripped, or the chunk dropped."""
    if usage is None or b'"usage":{' not in payload:
        return payload
    if b'"choices":[]' in payload:  # the final usage-only chunk
        return payload if usage.include_usage else None
    return payload if usage.continuous else _USAGE.sub(b',"usage":null', payload)


async def _relay_stream(exchange: PDExchange, response: ClientResponse) -> None:
    queue = exchange.events
    usage = exchange.admitted.usage if exchange.admitted.route != "/generate" else None
    event: RelayEvent | None = await queue.get()
    match event:
        case ClientGone():
            return
        case Failure(error):
            # Nothing was sent yet, so the failure keeps its own status code.
            await send_error(response, error, retry_after(error))
            return
    await response.start(200, _SSE_HEADERS + _count_header(exchange))
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
                await response.body(body, more=True)
                event = await queue.get()
            case Done():
                await response.body(body + _DONE_EVENT)
                return
            case Failure(error):
                # A stream that already started cannot change its status: an error event and no [DONE].
                await response.body(body + error.sse_event())
                return
            case ClientGone():
                return


async def _relay_whole(exchange: PDExchange, response: ClientResponse) -> None:
    answer: bytes | None = None
    while True:
        match await exchange.events.get():
            case bytes() as payload:
                answer = payload  # decode's whole answer, checked (one event; the last, were there more)
            case Done():
                if answer is None:  # cannot happen (decode's answer is checked before Done); never an empty 200
                    error = GatewayError(502, "the decode engine sent no answer", code="decode_failed")
                    await send_error(response, error)
                else:
                    await send_json(response, 200, answer, _count_header(exchange))
                return
            case Failure(error):
                await send_error(response, error, retry_after(error))
                return
            case ClientGone():
                return
