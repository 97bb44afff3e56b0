"""The SGLang engine client: generate requests, their bodies and event streams, aborts and telemetry reads.

Generate traffic runs only on *verified* connections: each new connection to a worker first reads `/server_info`
on that same connection and must find the engine identity the KV-pool gate passed. An engine restarted at the same
address (SGLang's restart closes every connection) therefore receives nothing until it is read and judged again.
Transport failures are mapped here into `routing.engines.errors`; nothing above this module sees HTTP machinery.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson

from routing.engines.errors import (
    EngineAnswerTooLarge,
    EngineBroken,
    EngineChanged,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    Role,
)
from routing.engines.http import Body, ConnectFailed, ConnectionPool, HttpConnection, HttpError, Response
from routing.engines.identity import parse_identity
from routing.engines.sse import EventSplitter, EventTooLarge

if TYPE_CHECKING:  # workers know engine identities; the client only calls their transitions
    from routing.workers import Worker

_JSON = ((b"content-type", b"application/json"),)
Headers = tuple[tuple[bytes, bytes], ...]
_ERROR_BODY_LIMIT = 1 << 16
_TELEMETRY_BODY_LIMIT = 16 << 20  # /server_info, /metrics, loads: a few hundred KiB from a real engine


class EngineResponse:
    """A 2xx generate response whose body is still to be read: whole, or as server-sent events."""

    __slots__ = ("_ended", "_response", "_splitter", "role")

    def __init__(self, role: Role, response: Response) -> None:
        self.role = role
        self._response = response
        self._splitter: EventSplitter | None = None
        self._ended = False

    async def body(self, max_bytes: int) -> bytes:
        """The whole body, at most `max_bytes` of it (EngineAnswerTooLarge beyond: nothing more is read)."""
        try:
            return await read_capped(self._response, max_bytes, self.role)
        except HttpError as exc:
            raise EngineBroken(self.role, f"{self.role} connection broke while answering: {exc}") from exc

    async def events(self, max_event_bytes: int) -> AsyncIterator[bytes]:
        """The `data:` payload of each event, `[DONE]` included; EngineAnswerTooLarge for an event over the cap."""
        while (payloads := await self.next_events(max_event_bytes)) is not None:
            for payload in payloads:
                yield payload

    async def next_events(self, max_event_bytes: int) -> list[bytes] | None:
        """The `data:` payloads of the events that came next (at least one), None once the stream has ended: one
        await per chunk from the engine, not a generator step per event."""
        splitter = self._splitter
        if splitter is None:
            splitter = self._splitter = EventSplitter(max_event_bytes)
        try:
            while not self._ended:
                chunk = await self._response.next_data()
                if chunk is None:
                    self._ended = True
                    return splitter.finish() or None
                payloads = splitter.feed(chunk)
                if payloads:
                    return payloads
            return None
        except EventTooLarge as exc:
            raise EngineAnswerTooLarge(self.role, "a streamed event", exc.limit) from None
        except HttpError as exc:
            raise EngineBroken(self.role, f"{self.role} stream broke: {exc}") from exc

    def close(self) -> None:
        """Done with it: a response not read to its end closes its connection (which SGLang takes as an abort)."""
        self._response.close()


class EngineLink:
    """A verified connection to one worker, reserved for one generate request: connecting both halves before
    sending either means a half that cannot be reached (or has changed) costs the other nothing."""

    __slots__ = ("_connection", "_pool", "_used", "worker")

    def __init__(self, worker: Worker, pool: ConnectionPool, connection: HttpConnection) -> None:
        self.worker = worker
        self._pool = pool
        self._connection = connection
        self._used = False

    async def generate(self, path: str, body: Body, headers: Headers = ()) -> EngineResponse:
        """Send a generate request (its JSON body in parts, `headers` beside content-type); returns once a 2xx
        status is in."""
        role: Role = self.worker.role
        self._used = True
        try:
            response = await self._pool.send_on(self._connection, b"POST", path, body, (*_JSON, *headers))
        except HttpError as exc:
            raise EngineBroken(role, f"{role} worker {self.worker.url} connection broke: {exc}",
                               worker_url=self.worker.url) from exc
        if response.status >= 300:
            raise await _rejection(role, self.worker.url, response)
        return EngineResponse(role, response)

    def release(self) -> None:
        """Not used after all: the connection goes back to the pool."""
        if not self._used:
            self._used = True
            self._pool.give_back(self._connection)


class EngineClient:
    """Connection pools to every engine; knows SGLang's routes, nothing about prefill/decode pairing."""

    def __init__(self, *, connect_timeout_s: float, verify_timeout_s: float, abort_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._verify_timeout_s = verify_timeout_s
        self._abort_timeout_s = abort_timeout_s
        self._generation: dict[Worker, ConnectionPool] = {}
        self._control: dict[str, ConnectionPool] = {}

    async def connect(self, worker: Worker) -> EngineLink:
        """A verified connection to `worker` (reused, or new and checked): nothing is sent on it yet."""
        role: Role = worker.role
        pool = self._generation.get(worker)
        if pool is None:
            pool = self._generation[worker] = self._pool(worker.url, verify=worker)
        try:
            return EngineLink(worker, pool, await pool.acquire())
        except ConnectFailed as exc:
            worker.mark_unreachable(f"connection failed: {exc}")
            raise EngineUnreachable(role, f"{role} worker {worker.url} unreachable: {exc}",
                                    worker_url=worker.url) from exc
        except HttpError as exc:
            raise EngineUnreachable(role, f"{role} worker {worker.url}: {exc}", worker_url=worker.url) from exc

    def connect_now(self, worker: Worker) -> EngineLink | None:
        """A connection to `worker` verified earlier and idle now, without waiting; None when there is none."""
        pool = self._generation.get(worker)
        connection = pool.take_idle() if pool is not None else None
        return EngineLink(worker, pool, connection) if pool is not None and connection is not None else None

    async def generate(self, worker: Worker, path: str, body: Body) -> EngineResponse:
        """Connect and send in one step (the lifecycle connects both halves first)."""
        return await (await self.connect(worker)).generate(path, body)

    async def abort(self, url: str, rid: str) -> bool:
        """Best-effort `POST /abort_request`; True when the engine accepted it."""
        try:
            async with asyncio.timeout(self._abort_timeout_s):
                response = await self._control_pool(url).request(b"POST", "/abort_request",
                                                                 (orjson.dumps({"rid": rid}),), _JSON)
                try:
                    await read_capped(response, _ERROR_BODY_LIMIT, "telemetry", truncate=True)
                finally:
                    response.close()  # a truncated answer's connection is not reused
                return response.status < 300
        except (HttpError, TimeoutError):
            return False

    async def get(self, url: str, path: str, *, timeout_s: float) -> tuple[int, bytes]:
        """A telemetry read: status and body."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._control_pool(url).request(b"GET", path)
                try:
                    return response.status, await read_capped(response, _TELEMETRY_BODY_LIMIT, "telemetry")
                finally:
                    response.close()
        except TimeoutError as exc:
            raise EngineTimeout("telemetry", f"{url}{path}: no answer in {timeout_s:g}s") from exc
        except ConnectFailed as exc:
            raise EngineUnreachable("telemetry", f"{url}{path}: {exc}") from exc
        except HttpError as exc:
            raise EngineBroken("telemetry", f"{url}{path}: {exc}") from exc

    async def get_json(self, url: str, path: str, *, timeout_s: float) -> Any:
        status, body = await self.get(url, path, timeout_s=timeout_s)
        if status >= 300:
            raise EngineRejected("telemetry", f"{url}{path} answered {status}", status=status)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise EngineBroken("telemetry", f"{url}{path}: not JSON") from exc

    async def close(self) -> None:
        for pool in [*self._generation.values(), *self._control.values()]:
            pool.close()
        self._generation.clear()
        self._control.clear()

    # ── connections ─────────────────────────────────────────────────────────────────────────────────────────
    def _control_pool(self, url: str) -> ConnectionPool:
        pool = self._control.get(url)
        if pool is None:
            pool = self._control[url] = self._pool(url)
        return pool

    def _pool(self, url: str, verify: Worker | None = None) -> ConnectionPool:
        parts = urlsplit(url)
        tls = ssl.create_default_context() if parts.scheme == "https" else None
        pool = ConnectionPool(parts.hostname or "", parts.port or (443 if tls else 80),
                              connect_timeout_s=self._connect_timeout_s, tls=tls)
        if verify is not None:
            pool.on_new_connection = lambda connection: self._verify(verify, pool, connection)
        return pool

    async def _verify(self, worker: Worker, pool: ConnectionPool, connection: HttpConnection) -> None:
        """Read `/server_info` on a new connection: the engine behind it must be the one the gate verified."""
        role: Role = worker.role
        expected = worker.verified
        try:
            async with asyncio.timeout(self._verify_timeout_s):
                status, body = await pool.fetch(connection, "/server_info", max_bytes=_TELEMETRY_BODY_LIMIT)
            identity = parse_identity(orjson.loads(body)) if status < 300 else None
        except TimeoutError as exc:
            raise EngineTimeout(role, f"{role} worker {worker.url} did not confirm its identity within "
                                      f"{self._verify_timeout_s:g}s", worker_url=worker.url) from exc
        except HttpError as exc:
            raise EngineUnreachable(role, f"{role} worker {worker.url}: identity check failed: {exc}",
                                    worker_url=worker.url) from exc
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            identity = None
        if expected is None or identity != expected:
            reason = ("a new connection found an engine that is not the verified one "
                      f"(now {identity}, verified {expected}); awaiting re-verification")
            worker.mark_changed(reason)
            raise EngineChanged(role, f"{role} worker {worker.url} changed: {reason}", worker_url=worker.url)


async def read_capped(response: Response, max_bytes: int, role: Role, *, truncate: bool = False) -> bytes:
    """A body of at most `max_bytes`: a declared length over it fails before any byte is read, a body that grows
    past it fails there (or, with `truncate`, ends there). Chunks are joined once, at the end."""
    declared = next((value for name, value in response.headers if name == b"content-length"), None)
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes and not truncate:
        raise EngineAnswerTooLarge(role, f"an answer of {int(declared)} bytes", max_bytes)
    parts: list[bytes] = []
    size = 0
    while (chunk := await response.next_data()) is not None:  # what each read brought, in one piece
        size += len(chunk)
        if size > max_bytes:
            if truncate:
                parts.append(chunk[:max_bytes - size + len(chunk)])
                break
            raise EngineAnswerTooLarge(role, "an answer", max_bytes)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _rejection(role: Role, url: str, response: Response) -> EngineError:
    try:
        detail = error_message(await read_capped(response, _ERROR_BODY_LIMIT, role, truncate=True))
    except HttpError:
        detail = ""
    finally:
        response.close()
    return EngineRejected(role, f"{role} worker {url} answered {response.status}: {detail}", status=response.status,
                          detail=detail, worker_url=url)


def error_message(body: bytes) -> str:
    """The human message inside any of SGLang's error envelopes, or the raw text."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:500]
    if isinstance(parsed, dict):
        inner = parsed.get("error", parsed)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])[:500]
        if isinstance(inner, str):
            return inner[:500]
    return str(parsed)[:500]
