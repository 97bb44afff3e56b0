"""In-process fake engines for the lifecycle: each half is driven step by step by the test, and everything the
gateway does to the engines (requests, closes, aborts) lands in one ordered log."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson

from routing.engines.errors import EngineError
from routing.workers import Worker

END = None  # pushed to end a body or an event stream


class FakeHalf:
    """One engine. `accept()` / `reject(error)` answer its request; `push(...)` feeds its body or events."""

    def __init__(self, role: str, log: list[tuple[str, str]]) -> None:
        self.role = role
        self.log = log
        self.bodies: list[dict[str, Any]] = []
        self._headers: asyncio.Future[None] | None = None
        self._items: asyncio.Queue[bytes | EngineError | None] = asyncio.Queue()
        self.requested = asyncio.Event()

    # what the gateway calls
    async def generate(self, body: Sequence[bytes | memoryview]) -> FakeStream:
        self.bodies.append(orjson.loads(b"".join(body)))
        self.log.append(("request", self.role))
        self._headers = asyncio.get_running_loop().create_future()
        self.requested.set()
        try:
            await self._headers
        except asyncio.CancelledError:
            self.log.append(("close", self.role))  # the real client closes a connection it stops waiting on
            raise
        return FakeStream(self)

    # what the test calls
    def accept(self) -> None:
        assert self._headers is not None, f"{self.role} has no request yet"
        self._headers.set_result(None)

    def reject(self, error: EngineError) -> None:
        assert self._headers is not None, f"{self.role} has no request yet"
        self._headers.set_exception(error)

    def push(self, *items: bytes | EngineError | None) -> None:
        for item in items:
            self._items.put_nowait(item)


class FakeStream:
    def __init__(self, half: FakeHalf) -> None:
        self._half = half

    async def body(self, max_bytes: int = 1 << 62) -> bytes:
        parts = []
        async for part in self._read():
            parts.append(part)
        return b"".join(parts)

    async def next_events(self, max_event_bytes: int = 1 << 62) -> list[bytes] | None:
        async for part in self._read():
            return [part]
        return None

    def close(self) -> None:
        self._half.log.append(("close", self._half.role))

    async def _read(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._half._items.get()
            if item is END:
                return
            if isinstance(item, EngineError):
                raise item
            yield item


class FakeLink:
    def __init__(self, half: FakeHalf) -> None:
        self._half = half

    async def generate(self, path: str, body: Sequence[bytes | memoryview],
                       headers: tuple[tuple[bytes, bytes], ...] = ()) -> FakeStream:
        return await self._half.generate(body)

    def release(self) -> None:
        self._half.log.append(("released unused", self._half.role))


class FakeEngines:
    """Implements what `gateway.pd.ports.Engines` needs; aborts answer after `abort_delay_s`."""

    def __init__(self, prefill: Worker, decode: Worker, abort_delay_s: float = 0.0) -> None:
        self.log: list[tuple[str, str]] = []
        self.halves = {prefill.url: FakeHalf("prefill", self.log), decode.url: FakeHalf("decode", self.log)}
        self.prefill = self.halves[prefill.url]
        self.decode = self.halves[decode.url]
        self.abort_delay_s = abort_delay_s
        self._connect_errors: dict[str, EngineError] = {}
        self._hanging: set[str] = set()

    def fail_connect(self, role: str, error: EngineError) -> None:
        """The next connection to that half fails (unreachable, or a restarted engine): nothing is sent on it."""
        self._connect_errors[role] = error

    def hang_connect(self, role: str) -> None:
        """Connections to that half never complete (an engine that accepts but never answers its identity read)."""
        self._hanging.add(role)

    def connect_now(self, worker: Worker) -> FakeLink | None:
        """At once unless a connect failure or hang is set (then both halves take the waiting path, as a new
        connection's identity read does)."""
        half = self.halves[worker.url]
        if self._hanging or self._connect_errors:
            return None
        self.log.append(("connect", half.role))
        return FakeLink(half)

    async def connect(self, worker: Worker) -> FakeLink:
        half = self.halves[worker.url]
        self.log.append(("connect", half.role))
        if half.role in self._hanging:
            await asyncio.get_running_loop().create_future()
        error = self._connect_errors.pop(half.role, None)
        if error is not None:
            raise error
        return FakeLink(half)

    async def abort(self, url: str, rid: str) -> bool:
        role = self.halves[url].role
        self.log.append(("abort", role))
        await asyncio.sleep(self.abort_delay_s)
        self.log.append(("abort answered", role))
        return True
