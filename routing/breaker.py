"""A circuit breaker for one leg of one worker, as sgl-router's `core/circuit_breaker.rs` runs it: closed, open after
`failure_threshold` failures in a row, half-open after `open_s` (one probe request at a time), closed again after
`success_threshold` probe successes in a row. A failed probe opens it again.

Only outcomes that say something about the engine count (5xx, broken connections, timeouts of its own leg); a
client's 4xx, a client gone, or a cancellation caused by the *other* half count for nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSpec:
    failure_threshold: int = 5
    success_threshold: int = 2
    open_s: float = 10.0


class CircuitBreaker:
    def __init__(self, spec: BreakerSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self._spec = spec
        self._now = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._probing = False

    def reconfigure(self, spec: BreakerSpec) -> None:
        self._spec = spec

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._now() - self._opened_at >= self._spec.open_s:
            return BreakerState.HALF_OPEN
        return self._state

    def admits(self) -> bool:
        """Whether a new request may go to this worker now."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._probing)

    def on_dispatch(self) -> None:
        """A request is going to this worker: while not closed, it is the probe."""
        if self.state is not BreakerState.CLOSED:
            self._state = BreakerState.HALF_OPEN
            self._probing = True

    def record(self, ok: bool) -> None:
        spec = self._spec
        self._probing = False
        if ok:
            self._failures = 0
            if self._state is BreakerState.CLOSED:
                return
            self._state = BreakerState.HALF_OPEN
            self._successes += 1
            if self._successes >= spec.success_threshold:
                self._state, self._successes = BreakerState.CLOSED, 0
            return
        self._successes = 0
        self._failures += 1
        if self._state is not BreakerState.CLOSED or self._failures >= spec.failure_threshold:
            self._state, self._opened_at, self._failures = BreakerState.OPEN, self._now(), 0

    def released_without_outcome(self) -> None:
        """A probe that ended without saying anything about the engine (client gone, other half failed)."""
        self._probing = False
