"""Server-sent events: the `data:` payloads of an event stream, in order."""

from __future__ import annotations

from collections.abc import AsyncIterator


async def data_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Each event's `data:` payload; splits whatever bytes arrive itself (cheaper than a line iterator)."""
    pending = b""
    async for chunk in chunks:
        pending = pending + chunk if pending else chunk
        start = 0
        while True:
            end = pending.find(b"\n\n", start)
            if end < 0:
                break
            for payload in _payloads(pending[start:end]):
                yield payload
            start = end + 2
        pending = pending[start:]
    if pending.strip():
        for payload in _payloads(pending):
            yield payload


def _payloads(event: bytes) -> list[bytes]:
    if event.startswith(b"data:") and b"\n" not in event:
        return [event[5:].lstrip(b" ")]
    return [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
