"""The SGLang HTTP client: generate requests, server-sent-event parsing, aborts and telemetry reads.

aiohttp rather than httpx on this path: measured on this machine, an aiohttp keep-alive POST costs ~57 µs of client
CPU against ~720 µs for httpx, and the gateway's budget is 500 µs for a whole PD request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

JSON_HEADERS = {"Content-Type": "application/json"}


class EngineError(Exception):
    """An engine answered with an error, could not be reached, or sent something unusable."""

    def __init__(self, role: str, message: str, *, status: int | None = None, timeout: bool = False,
                 length_rejection: bool = False, unreachable: bool = False) -> None:
        super().__init__(message)
        self.role = role
        self.status = status
        self.timeout = timeout
        self.length_rejection = length_rejection
        self.unreachable = unreachable


# Substrings of SGLang's own prompt-length rejections (tokenizer manager, scheduler and PD queues, §1.12).
_LENGTH_REJECTIONS = (
    "longer than the model's context length",
    "exceeds the model's maximum context length",
    "exceeds the maximum allowed length",
    "exceeds the maximum number of tokens",
)


def is_length_rejection(message: str) -> bool:
    return any(fragment in message for fragment in _LENGTH_REJECTIONS)


def error_message(body: bytes) -> str:
    """The human message inside any of SGLang's three error envelopes, or the raw text."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:500]
    if isinstance(parsed, dict):
        inner = parsed.get("error", parsed)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"][:500]
        if isinstance(inner, str):
            return inner[:500]
    return str(parsed)[:500]


async def iter_sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payload of each `data:` event, in order; reads whatever bytes arrive and splits them itself, which is
    cheaper than aiohttp's line iterator."""
    pending = b""
    async for chunk in response.content.iter_any():
        pending += chunk
        while True:
            end = pending.find(b"\n\n")
            if end < 0:
                break
            event, pending = pending[:end], pending[end + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].lstrip(b" ")
    if pending.strip():
        for line in pending.split(b"\n"):
            if line.startswith(b"data:"):
                yield line[5:].lstrip(b" ")


class EngineClient:
    """One connection pool to every engine; knows SGLang's routes, nothing about prefill/decode pairing."""

    def __init__(self, *, connect_timeout_s: float, abort_timeout_s: float, connection_limit: int = 0) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._abort_timeout = aiohttp.ClientTimeout(total=abort_timeout_s)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connection_limit, ttl_dns_cache=300, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
            json_serialize=lambda obj: orjson.dumps(obj).decode(),
            auto_decompress=False,
        )

    async def close(self) -> None:
        await self._session.close()

    async def post(self, role: str, url: str, body: bytes) -> aiohttp.ClientResponse:
        """Send a generate request and return once response headers are in. Non-2xx becomes EngineError."""
        try:
            response = await self._session.post(url, data=body, headers=JSON_HEADERS)
        except aiohttp.ClientConnectorError as exc:
            raise EngineError(role, f"{role} worker unreachable: {exc.os_error or exc}", unreachable=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError(role, f"{role} worker connection failed: {exc!r}") from exc
        if response.status >= 300:
            try:
                detail = error_message(await response.read())
            except (aiohttp.ClientError, OSError):
                detail = ""
            finally:
                response.close()
            raise EngineError(role, f"{role} worker answered {response.status}: {detail}", status=response.status,
                              length_rejection=response.status == 400 and is_length_rejection(detail))
        return response

    async def abort(self, base_url: str, rid: str) -> bool:
        """Best-effort `POST /abort_request`; True when the engine accepted it."""
        try:
            async with self._session.post(f"{base_url}/abort_request", data=orjson.dumps({"rid": rid}),
                                          headers=JSON_HEADERS, timeout=self._abort_timeout) as response:
                await response.read()
                return response.status < 300
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False

    async def get(self, base_url: str, path: str, *, timeout_s: float) -> tuple[int, bytes]:
        """A telemetry read: status and body. Connection problems raise EngineError."""
        try:
            async with self._session.get(f"{base_url}{path}",
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return response.status, await response.read()
        except asyncio.TimeoutError as exc:
            raise EngineError("telemetry", f"{base_url}{path}: no answer in {timeout_s:g}s", timeout=True) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError("telemetry", f"{base_url}{path}: {exc!r}") from exc

    async def get_json(self, base_url: str, path: str, *, timeout_s: float) -> Any:
        status, body = await self.get(base_url, path, timeout_s=timeout_s)
        if status >= 300:
            raise EngineError("telemetry", f"{base_url}{path} answered {status}", status=status)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise EngineError("telemetry", f"{base_url}{path}: not JSON") from exc
