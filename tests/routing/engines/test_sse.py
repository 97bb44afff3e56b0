"""The event-stream splitter: every blank-line delimiter (\\n\\n, \\r\\n\\r\\n and mixed) wherever chunks split it, a
cap on one event, and linear time for a huge event that never ends."""

from __future__ import annotations

import time

import pytest

from routing.engines.sse import EventSplitter, EventTooLarge

CAP = 1 << 20


def _events(parts: list[bytes], cap: int = CAP) -> list[bytes]:
    splitter = EventSplitter(cap)
    return [payload for part in parts for payload in splitter.feed(part)] + splitter.finish()


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_every_split_of_a_stream_gives_the_same_events(newline: bytes) -> None:
    stream = (b'data: {"a":1}' + newline * 2 + b": a comment" + newline + b"data: {\"b\":2}" + newline * 2
              + b"data: [DONE]" + newline * 2)
    expected = [b'{"a":1}', b'{"b":2}', b"[DONE]"]
    assert _events([stream]) == expected
    for cut in range(1, len(stream)):
        assert _events([stream[:cut], stream[cut:]]) == expected, cut
    assert _events([stream[i:i + 1] for i in range(len(stream))]) == expected


def test_mixed_line_endings_end_events_too() -> None:
    assert _events([b"data: 1\r\n\ndata: 2\n\r\ndata: 3\n\n"]) == [b"1", b"2", b"3"]


def test_an_event_over_the_cap_fails_once_it_is_over_whether_it_ends_or_not() -> None:
    with pytest.raises(EventTooLarge):
        _events([b"data: " + b"x" * 2000], cap=1024)  # unterminated, in one chunk
    with pytest.raises(EventTooLarge):
        _events([b"data: " + b"x" * 2000 + b"\n\n"], cap=1024)  # terminated, but too large
    with pytest.raises(EventTooLarge):
        _events([b"data: 1\n\n"] + [b"x" * 100] * 20, cap=1024)  # grown chunk by chunk
    assert _events([b"data: " + b"x" * 1000 + b"\n\n"], cap=1024) == [b"x" * 1000]


def test_a_huge_unterminated_event_is_scanned_in_linear_time() -> None:
    """50 MB in 64 KiB chunks under a cap above it: re-joining and re-searching the pending bytes per chunk, as
    before, took 30 s here; scanning only the new bytes takes about 0.25 s (the margin: a shared machine)."""
    chunk = b"x" * (64 << 10)
    parts = [b"data: "] + [chunk] * (50 * 10**6 // len(chunk)) + [b"\n\n"]
    started = time.perf_counter()
    (payload,) = _events(parts, cap=64 << 20)
    elapsed = time.perf_counter() - started
    assert len(payload) == len(chunk) * (len(parts) - 2)
    assert elapsed < 3.0, elapsed


def test_events_before_one_over_the_cap_in_the_same_bytes_come_out_first() -> None:
    """The reader takes whatever one socket read brought, many events at once: those before an oversized one are
    still returned, and the failure comes on the next call (also through `finish`)."""
    for tail in (b"data: " + b"x" * 100 + b"\n\n", b"data: " + b"x" * 100):  # whole, or still unfinished
        splitter = EventSplitter(64)
        assert splitter.feed(b'data: {"a":1}\n\ndata: {"b":2}\n\n' + tail) == [b'{"a":1}', b'{"b":2}']
        with pytest.raises(EventTooLarge):
            splitter.feed(b"data: {}\n\n")
        with pytest.raises(EventTooLarge):
            splitter.finish()
