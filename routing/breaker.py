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


class BreakerState(str, Enum):  # noqa: UP042 (str() of a StrEnum would change the labels it is printed in)
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSpec:
    failure_threshold: int = 5
    success_threshold: int = 2
    open_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Ticket:
    """What the breaker handed one request: the breaker period it was dispatched in, and whether it is the probe.
    Outcomes of requests dispatched before the breaker last opened say nothing about the engine now."""

    period: int
    probe: bool


class CircuitBreaker:
    def __init__(self, spec: BreakerSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self._spec = spec
        self._now = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._period = 0  # +1 at each opening
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

    def on_dispatch(self) -> Ticket:
        """A request is going to this worker: while not closed, it is the one probe."""
        if self.state is BreakerState.CLOSED:
            return Ticket(self._period, probe=False)
        self._state = BreakerState.HALF_OPEN
        self._probing = True
        return Ticket(self._period, probe=True)

    def record(self, ok: bool, ticket: Ticket) -> None:
        """An outcome of the request holding `ticket` (see the module docstring for what counts)."""
        if ticket.period != self._period:
            return  # dispatched before the breaker last opened
        if ticket.probe:
            self._probing = False
        elif self._state is not BreakerState.CLOSED:
            return  # only the probe speaks while the breaker is not closed
        spec = self._spec
        if ok:
            self._failures = 0
            if self._state is BreakerState.CLOSED:
                return
            self._successes += 1
            if self._successes >= spec.success_threshold:
                self._state, self._successes = BreakerState.CLOSED, 0
            return
        self._successes = 0
        self._failures += 1
        if self._state is not BreakerState.CLOSED or self._failures >= spec.failure_threshold:
            self._state, self._opened_at, self._failures = BreakerState.OPEN, self._now(), 0
            self._period += 1
            self._probing = False

    def release(self, ticket: Ticket) -> None:
        """The request holding `ticket` ended (with or without an outcome): a probe frees the way for the next."""
        if ticket.probe and ticket.period == self._period:
            self._probing = False
