"""Cooperative GIL hand-over for long pure-Python loops and sliced C calls in worker threads.

A thread that never releases the GIL makes the event loop wait out the interpreter's 5 ms switch interval
each time it wants to run, and with several such threads it can lose that race repeatedly (tens of ms).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from functools import partial

YIELD_CHARS = 1 << 17  # characters of linear C work (slicing, encoding, hashing) between hand-overs: ≲ 0.3 ms
YIELD_S = 0.0005  # the longest a pure-Python loop holds the GIL before handing it over
# Characters one regex call scans: ≲ 1 ms even where every position starts a partial match.
SCAN_CHARS = 1 << 14


# Each releases the GIL for a moment. `sched_yield` costs ~1 µs, `time.sleep(0)` Linux's timer slack (~60 µs).
_release_gil = getattr(os, "sched_yield", None) or partial(time.sleep, 0)


def yield_gil() -> None:
    """Release and re-take the GIL, letting a waiting thread (the event loop) run first."""
    _release_gil()


class Pacer:
    """Hands the GIL over from a Python loop whose steps cost very different amounts of time."""

    def __init__(self) -> None:
        self._due = time.perf_counter() + YIELD_S

    def step(self) -> None:
        if (now := time.perf_counter()) >= self._due:
            yield_gil()
            self._due = now + YIELD_S


def finditer_sliced(pattern: re.Pattern[str], text: str, lo: int, hi: int, reach: int) -> Iterator[re.Match[str]]:
    """`pattern.finditer(text, lo, hi)`, scanned SCAN_CHARS at a time with the GIL handed over in between.

    `reach`: the most characters a match, with its look-ahead, spans. Each slice's scan reads that far past
    its end, so a match starting inside it is found whole, exactly as one scan finds it; matches starting
    later are left to the next slice. Patterns must not look behind their start.
    """
    pacer = Pacer()
    pos = lo
    while pos < hi:
        end = min(pos + SCAN_CHARS, hi)
        for m in pattern.finditer(text, pos, min(end + reach - 1, hi)):
            if m.start() >= end:
                break
            pos = m.end()
            yield m
            pacer.step()
        pos = max(pos, end)
        pacer.step()
