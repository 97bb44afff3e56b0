"""What the exchange needs from the engine client and from the tenant's limits (a fake engine client drives the
in-process tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from routing.workers import Worker


class EngineStream(Protocol):
    async def body(self) -> bytes: ...
    def events(self) -> AsyncIterator[bytes]: ...
    def close(self) -> None: ...


class EngineLink(Protocol):
    """A verified connection to one worker, reserved for one request."""

    async def generate(self, path: str, body: Sequence[bytes | memoryview],
                       headers: tuple[tuple[bytes, bytes], ...] = ()) -> EngineStream: ...
    def release(self) -> None: ...


class Engines(Protocol):
    async def connect(self, worker: Worker) -> EngineLink: ...
    async def abort(self, url: str, rid: str) -> bool: ...


class TenantHold(Protocol):
    """A tenant's pass, owned by the exchange once dispatched: its output charged as it streams, given back at close."""

    @property
    def charges_output(self) -> bool: ...
    def output_so_far(self, tokens: int) -> None: ...
    def release(self, output_tokens: int = 0) -> None: ...
