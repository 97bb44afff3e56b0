"""Decode's released events → the client: an event stream as it comes, or the whole body a non-streaming client
asked for, built as the events arrive.

The gateway always streams from decode (to know when the first token came); a non-streaming client gets the same
body SGLang would have sent it. Memory stays proportional to the output: /generate events are cumulative, so only
the last one is kept; OpenAI chunks are folded into the response as they come.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import orjson
from starlette.types import Receive, Send

from gateway.admission.requests import UsageOptions
from gateway.errors import GatewayError
from gateway.http.intake import Headers, retry_after
from gateway.pd.events import ClientGone, Done, Failure, RelayEvent
from gateway.pd.exchange import PDExchange

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_DONE_EVENT = b"data: [DONE]\n\n"
# A usage object inside an OpenAI stream chunk (one level of nesting: prompt_tokens_details).
_USAGE = re.compile(rb',"usage":\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}')


async def send_json(send: Send, status: int, body: bytes, headers: Headers = ()) -> None:
    all_headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: GatewayError, headers: Headers = ()) -> None:
    await send_json(send, error.status, error.json(), headers)


async def relay(exchange: PDExchange, send: Send) -> None:
    """The exchange's events to the client, as it asked for them."""
    if exchange.admitted.stream:
        await _relay_stream(exchange, send)
    else:
        await _relay_whole(exchange, send)


def _count_header(exchange: PDExchange) -> list[tuple[bytes, bytes]]:
    """The gateway's own prompt count, so a client (and the parity test) can compare it with the engine's usage."""
    return [(b"x-kvgate-prompt-tokens", str(exchange.prompt_tokens).encode())]


async def watch_disconnect(receive: Receive, exchange: PDExchange) -> None:
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
    event: RelayEvent | None = await queue.get()
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


# ── the whole body, from the events ─────────────────────────────────────────────────────────────────────────
class Assembler(Protocol):
    def add(self, payload: bytes) -> None: ...
    def body(self) -> bytes: ...


def assembler_for(route: str) -> Assembler:
    if route == "/generate":
        return GenerateAssembler()
    if route == "/v1/chat/completions":
        return ChatAssembler()
    return CompletionAssembler()


class GenerateAssembler:
    """SGLang's /generate stream is cumulative: its last event is the whole response."""

    def __init__(self) -> None:
        self._last = b"{}"

    def add(self, payload: bytes) -> None:
        self._last = payload

    def body(self) -> bytes:
        return self._last


class _OpenAIAssembler:
    object_name = ""

    def __init__(self) -> None:
        self._head: dict[str, Any] | None = None
        self._usage: Any = None
        self._finish_reason: Any = None
        self._matched_stop: Any = None

    def add(self, payload: bytes) -> None:
        chunk = orjson.loads(payload)
        if self._head is None:
            self._head = {"id": chunk.get("id"), "object": self.object_name, "created": chunk.get("created"),
                          "model": chunk.get("model")}
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
            if "matched_stop" in choice:
                self._matched_stop = choice["matched_stop"]
            self._add_choice(choice)

    def body(self) -> bytes:
        head = self._head or {"id": None, "object": self.object_name, "created": None, "model": None}
        return orjson.dumps({**head, "choices": [self._choice()], "usage": self._usage})

    def _add_choice(self, choice: dict[str, Any]) -> None:
        raise NotImplementedError

    def _choice(self) -> dict[str, Any]:
        raise NotImplementedError


class ChatAssembler(_OpenAIAssembler):
    object_name = "chat.completion"

    def __init__(self) -> None:
        super().__init__()
        self._role = "assistant"
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._logprobs: list[Any] = []

    def _add_choice(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        self._role = delta.get("role") or self._role
        if delta.get("content"):
            self._content.append(delta["content"])
        if delta.get("reasoning_content"):
            self._reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or ():
            self._merge_tool_call(call)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content"):
            self._logprobs.extend(logprobs["content"])

    def _merge_tool_call(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", len(self._tool_calls))
        call = self._tool_calls.setdefault(index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""

    def _choice(self) -> dict[str, Any]:
        tool_calls = [self._tool_calls[i] for i in sorted(self._tool_calls)] or None
        message = {"role": self._role,
                   "content": "".join(self._content) if self._content or not tool_calls else None,
                   "reasoning_content": "".join(self._reasoning) or None, "tool_calls": tool_calls}
        return {"index": 0, "message": message, "logprobs": {"content": self._logprobs} if self._logprobs else None,
                "finish_reason": self._finish_reason, "matched_stop": self._matched_stop}


class CompletionAssembler(_OpenAIAssembler):
    object_name = "text_completion"

    def __init__(self) -> None:
        super().__init__()
        self._text: list[str] = []
        self._logprobs: dict[str, list[Any]] | None = None

    def _add_choice(self, choice: dict[str, Any]) -> None:
        self._text.append(choice.get("text") or "")
        part = choice.get("logprobs")
        if isinstance(part, dict) and part:
            self._logprobs = self._logprobs or {key: [] for key in part}
            for key, values in part.items():
                if isinstance(values, list):
                    self._logprobs.setdefault(key, []).extend(values)

    def _choice(self) -> dict[str, Any]:
        return {"index": 0, "text": "".join(self._text), "logprobs": self._logprobs,
                "finish_reason": self._finish_reason, "matched_stop": self._matched_stop}
