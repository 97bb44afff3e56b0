"""Server-sent events: the `data:` payloads of an event stream, in order, each event bounded in size.

The pending bytes of an unfinished event are scanned once: each chunk is searched only from just before where the
last search stopped (a delimiter may straddle two chunks), so an engine that streams one huge event without a blank
line costs linear time, and at most `max_event_bytes` are ever held for it.
"""

from __future__ import annotations

# A blank line ends an event; lines end in \n or \r\n, so every delimiter contains one of these, starting at the
# line end of the event's last line: \n\n, \n\r\n (covering \r\n\n and \r\n\r\n).
_DELIMITERS = (b"\n\n", b"\n\r\n")
_OVERLAP = 2  # the longest delimiter less one byte: how far back a new search starts


class EventTooLarge(Exception):
    """One event grew past the cap without ending."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"an event of more than {limit} bytes (at least {size})")
        self.size = size
        self.limit = limit


class EventSplitter:
    """Bytes as they arrive → the `data:` payloads of the events they complete, synchronously (one call per chunk:
    no generator per event). The common chunk — whole events ending in \n\n, nothing carried over, no \r — is split
    in one pass."""

    __slots__ = ("_failed", "_max", "_pending", "_scanned")

    def __init__(self, max_event_bytes: int) -> None:
        self._max = max_event_bytes
        self._pending = bytearray()
        self._scanned = 0  # _pending[:_scanned] holds no delimiter start (bar the last _OVERLAP bytes)
        # An event over the cap behind whole events in the same bytes: those go out first, the failure next call.
        self._failed: EventTooLarge | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events `chunk` completes; EventTooLarge once an event exceeds the cap (after the
        payloads of the events before it, which the call before returns)."""
        if self._failed is not None:
            raise self._failed
        if not self._pending and chunk.endswith(b"\n\n") and b"\r" not in chunk:
            payloads: list[bytes] = []
            for event in chunk[:-2].split(b"\n\n"):
                if len(event) > self._max:
                    return self._fail(payloads, EventTooLarge(len(event), self._max))
                if event.startswith(b"data:") and b"\n" not in event:
                    payloads.append(event[5:].lstrip(b" "))
                elif event:
                    payloads.extend(_payloads(event))
            return payloads
        return self._feed_slowly(chunk)

    def _feed_slowly(self, chunk: bytes) -> list[bytes]:
        payloads: list[bytes] = []
        pending, scanned = self._pending, self._scanned
        if not pending:
            # Nothing carried over: search the chunk itself (no copy into the buffer).
            start, scanned = 0, 0
            view: bytes | bytearray = chunk
        else:
            pending += chunk
            view = pending
            start = 0
        while True:
            end, width = _find_delimiter(view, max(start, scanned - _OVERLAP))
            if end < 0:
                break
            if end - start > self._max:
                return self._fail(payloads, EventTooLarge(end - start, self._max))
            payloads.extend(_payloads(bytes(view[start:end])))
            start = end + width
            scanned = start
        rest = len(view) - start
        if rest > self._max:
            return self._fail(payloads, EventTooLarge(rest, self._max))
        if view is pending:
            del pending[:start]
        else:
            self._pending = pending = bytearray(chunk[start:]) if rest else bytearray()
        self._scanned = len(pending)
        return payloads

    def _fail(self, payloads: list[bytes], error: EventTooLarge) -> list[bytes]:
        self._failed = error
        self._pending = bytearray()
        if payloads:
            return payloads
        raise error

    def finish(self) -> list[bytes]:
        """The stream ended: the payloads of an event it left without its blank line."""
        if self._failed is not None:
            raise self._failed
        pending, self._pending = self._pending, bytearray()
        return _payloads(bytes(pending)) if bytes(pending).strip() else []


def _find_delimiter(buffer: bytes | bytearray, since: int) -> tuple[int, int]:
    """Where the first event delimiter at or after `since` starts (its line end included) and its width; -1: none."""
    best, width = -1, 0
    for delimiter in _DELIMITERS:
        at = buffer.find(delimiter, since, len(buffer) if best < 0 else best + len(delimiter))
        if at >= 0 and (best < 0 or at < best):
            best, width = at, len(delimiter)
    if best > 0 and buffer[best - 1:best] == b"\r":
        return best - 1, width + 1  # the event's last line ended in \r\n
    return best, width


def _payloads(event: bytes) -> list[bytes]:
    if event.startswith(b"data:") and b"\n" not in event:
        return [event[5:].lstrip(b" ")]
    return [line[5:].lstrip(b" ").rstrip(b"\r") for line in event.split(b"\n") if line.startswith(b"data:")]
