"""How many retries the gateway may add: at most `ratio` of the requests it has seen, plus a small floor per second
(as Finagle's RetryBudget), so a failing fleet sees retries shrink to a trickle instead of doubling its load."""

from __future__ import annotations

import time
from collections.abc import Callable


class RetryBudget:
    def __init__(self, ratio: float = 0.2, floor_per_s: float = 5.0, cap: float = 100.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ratio = ratio
        self._floor_per_s = floor_per_s
        self._cap = cap
        self._clock = clock
        self._balance = cap / 10
        self._last = clock()

    def deposit(self) -> None:
        """One request was dispatched."""
        self._balance = min(self._cap, self._balance + self._ratio)

    def withdraw(self) -> bool:
        """Whether one retry may be made now (it is then counted)."""
        now = self._clock()
        self._balance = min(self._cap, self._balance + (now - self._last) * self._floor_per_s)
        self._last = now
        if self._balance < 1:
            return False
        self._balance -= 1
        return True
