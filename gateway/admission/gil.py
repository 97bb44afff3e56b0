"""Cooperative GIL hand-over for long pure-Python loops in worker threads.

Without it the event loop, wanting the GIL back, waits out the interpreter's 5 ms switch interval each time.
"""

from __future__ import annotations

import time

YIELD_CHARS = 1 << 17  # characters of text processed between hand-overs: well under a millisecond of work


def yield_gil() -> None:
    time.sleep(0)  # releases and re-takes the GIL, letting a waiting thread (the event loop) run first
