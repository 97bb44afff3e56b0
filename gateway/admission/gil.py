"""Cooperative GIL hand-over for long pure-Python loops and sliced C calls in worker threads.

A thread that never releases the GIL makes the event loop wait out the interpreter's 5 ms switch interval
each time it wants to run, and with several such threads it can lose that race repeatedly (tens of ms).

The hand-over is `time.sleep(0)`: it leaves the GIL free for Linux's timer slack (~60 µs), long enough for the
waiting thread to wake and take it. A shorter release (`os.sched_yield`, ~1 µs) is re-taken before the waiter
wakes, and, repeated often, keeps resetting the waiter's 5 ms timer: the event loop then starves for seconds.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

YIELD_CHARS = 1 << 17  # characters of linear C work (slicing, encoding, hashing) between hand-overs: ≲ 0.3 ms
YIELD_S = 0.001  # the longest a loop holds the GIL before handing it over (each hand-over costs ~60 µs)
# Characters one regex call scans: ≲ 1 ms even where every position starts a partial match.
SCAN_CHARS = 1 << 14


_handed_over = threading.local()  # per thread: when it last handed the GIL over through `pace`


def start_pacing() -> None:
    """Start this thread's pacing clock (at the start of a job: a job of less than YIELD_S never hands over)."""
    _handed_over.at = time.perf_counter()


def pace() -> None:
    """Hand the GIL over if this thread has not done so for YIELD_S: call it at every step of a long loop."""
    if (now := time.perf_counter()) - getattr(_handed_over, "at", 0.0) >= YIELD_S:
        time.sleep(0)  # releases the GIL, letting a waiting thread (the event loop) take it, then re-takes it
        _handed_over.at = now


def finditer_sliced(pattern: re.Pattern[str], text: str, lo: int, hi: int, reach: int) -> Iterator[re.Match[str]]:
    """`pattern.finditer(text, lo, hi)`, scanned SCAN_CHARS at a time with the GIL handed over in between.

    `reach`: the most characters a match, with its look-ahead, spans. Each slice's scan reads that far past
    its end, so a match starting inside it is found whole, exactly as one scan finds it; matches starting
    later are left to the next slice. A look-behind sees the text before a slice as one scan would.
    """
    pos = lo
    while pos < hi:
        end = min(pos + SCAN_CHARS, hi)
        for m in pattern.finditer(text, pos, min(end + reach - 1, hi)):
            if m.start() >= end:
                break
            pos = m.end()
            yield m
            pace()
        pos = max(pos, end)
        pace()
