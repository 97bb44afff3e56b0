"""What the exchange needs from the engine client and from the tenant's limits (a fake engine client drives the
in-process tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from routing.workers import Worker


class EngineStream(Protocol):
    async def body(self, max_bytes: int) -> bytes: ...
    async def next_events(self, max_event_bytes: int) -> list[bytes] | None: ...  # None: the stream ended
    def close(self) -> None: ...


class EngineLink(Protocol):
    """A verified connection to one worker, reserved for one request."""

    async def generate(self, path: str, body: Sequence[bytes | memoryview],
                       headers: tuple[tuple[bytes, bytes], ...] = ()) -> EngineStream: ...
    def release(self) -> None: ...


class Engines(Protocol):
    def connect_now(self, worker: Worker) -> EngineLink | None: ...  # an idle verified connection, or None
    async def connect(self, worker: Worker) -> EngineLink: ...
    async def abort(self, url: str, rid: str) -> bool: ...


def connect_both_now(engines: Engines, prefill: Worker, decode: Worker) -> tuple[EngineLink, EngineLink] | None:
    """Both halves' idle verified connections, taken at once (the common case under load: no task, no wait), or
    None, with nothing taken."""
    first = engines.connect_now(prefill)
    if first is None:
        return None
    second = engines.connect_now(decode)
    if second is None:
        first.release()
        return None
    return first, second


async def connect_both(engines: Engines, prefill: Worker, decode: Worker,
                       ) -> tuple[EngineLink | BaseException, EngineLink | BaseException]:
    """A verified connection to each half, at once. Cancelled meanwhile (a timeout, an operator's abort, shutdown
    while one half is still connecting), a half that did connect goes back to its pool instead of staying checked
    out for good."""
    connecting = [asyncio.ensure_future(engines.connect(worker)) for worker in (prefill, decode)]
    try:
        first, second = await asyncio.gather(*connecting, return_exceptions=True)
    except asyncio.CancelledError:
        for task in connecting:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().release()
        raise
    return first, second


class TenantHold(Protocol):
    """A tenant's pass, owned by the exchange once dispatched: its output charged as it streams, given back at close."""

    @property
    def charges_output(self) -> bool: ...
    def output_so_far(self, tokens: int) -> None: ...
    def release(self, output_tokens: int = 0) -> None: ...
