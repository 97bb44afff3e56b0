"""Workers: one SGLang engine each. A worker owns its state and its transitions; others ask, never assign.

A worker takes traffic only while it is *verified* (the KV-pool gate passed the engine identity it last read) and
*healthy* (its telemetry reads succeed). Any sign that the engine may have changed takes it out of rotation until
the monitor has read and judged it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from routing.breaker import BreakerSpec, BreakerState, CircuitBreaker, Ticket
from routing.deployment_checks import CheckOutcome
from routing.engine_load import EngineLoad
from routing.engines.identity import EngineIdentity
from routing.prefix_index import CacheIndex
from routing.stable_hash import stable_hash

Role = Literal["prefill", "decode"]

log = logging.getLogger("kvgate.workers")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    url: str
    role: Role
    bootstrap_port: int | None = None
    origin: str = "config"  # where it came from: config, admin, or dns:NAME

class Worker:
    """One engine: where it is, what the gate verified about it, whether it is healthy, what it is doing."""

    def __init__(self, spec: WorkerSpec, *, breaker: BreakerSpec = BreakerSpec(),
                 max_inflight: int | None = None) -> None:
        self.spec = spec
        self.url = spec.url
        self.hash_seed = stable_hash(spec.url.encode())  # this worker's place in rendezvous hashing
        self.role: Role = spec.role
        self.bootstrap_port = spec.bootstrap_port
        host = urlsplit(spec.url).hostname or ""
        # SGLang expects a bracketed IPv6 literal in bootstrap_host, as its own router sends it.
        self.bootstrap_host = f"[{host}]" if ":" in host else host
        self._verified: EngineIdentity | None = None
        self._healthy = True
        self._out_reason = "not verified yet"
        self._in_flight = 0
        self._in_flight_elsewhere = 0  # other gateway replicas' requests on this engine, as of the last fleet sync
        self._failures = 0
        self._successes = 0
        self._on_needs_verification: Callable[[Worker], None] | None = None
        self._on_capacity: Callable[[Worker], None] | None = None
        self._breaker = CircuitBreaker(breaker)
        self._max_inflight = max_inflight
        self._draining = False
        self._engine_load: tuple[float, EngineLoad] | None = None  # (when read, what the engine said)
        self._checks: tuple[CheckOutcome, ...] = ()
        self._prefill_backlog = 0  # prompt tokens this gateway sent that the engine has yet to prefill (uncached)
        self._reserved_tokens = 0  # prompt + max new tokens of this gateway's requests in flight on the engine
        # A prefill's radix cache as kvgate knows it (routing.prefix_index); None until a cache-aware policy asks.
        self.cache_index: CacheIndex | None = None
        self._on_join: Callable[[Worker], None] | None = None

    def __repr__(self) -> str:
        return f"Worker({self.role} {self.url})"

    # ── state, read-only from outside ───────────────────────────────────────────────────────────────────────
    @property
    def verified(self) -> EngineIdentity | None:
        """The engine identity the gate last passed; None while the worker is out of rotation."""
        return self._verified

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def usable(self) -> bool:
        """In rotation: verified, healthy, not draining, its breaker not open. (It may still be at capacity.)"""
        return self._healthy and self._verified is not None and not self._draining and self._breaker.admits()

    @property
    def has_room(self) -> bool:
        return self._max_inflight is None or self._in_flight < self._max_inflight

    @property
    def out_of_rotation_reason(self) -> str:
        if self._verified is None:
            return self._out_reason
        if not self._healthy:
            return "unhealthy"
        if self._draining:
            return "draining"
        if not self._breaker.admits():
            return f"circuit breaker {self._breaker.state.value}"
        return ""

    @property
    def in_flight(self) -> int:
        """Requests this gateway process has in flight on the engine."""
        return self._in_flight

    @property
    def fleet_in_flight(self) -> int:
        """Requests every live gateway replica has in flight on the engine (others' as of the last fleet sync)."""
        return self._in_flight + self._in_flight_elsewhere

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

    @property
    def checks(self) -> tuple[CheckOutcome, ...]:
        """The deployment checks of its last judgement (routing.deployment_checks)."""
        return self._checks

    def engine_load(self, max_age_s: float) -> int | None:
        """The engine's own load (KV tokens in use or queued) if read within `max_age_s`; stale data is not trusted."""
        reading = self._engine_reading(max_age_s)
        return reading.tokens if reading is not None else None

    def engine_used_tokens(self, max_age_s: float) -> int | None:
        """KV tokens the engine has in use, if read within `max_age_s`."""
        reading = self._engine_reading(max_age_s)
        return reading.used_tokens if reading is not None else None

    def _engine_reading(self, max_age_s: float) -> EngineLoad | None:
        reading = self._engine_load
        if reading is None or time.monotonic() - reading[0] > max_age_s:
            return None
        return reading[1]

    @property
    def prefill_backlog(self) -> int:
        """Uncached prompt tokens of this gateway's requests the engine has not finished prefilling: its queue."""
        return self._prefill_backlog

    @property
    def reserved_tokens(self) -> int:
        """KV tokens this gateway's requests in flight may hold on the engine (prompt + max new tokens each)."""
        return self._reserved_tokens

    # ── transitions ─────────────────────────────────────────────────────────────────────────────────────────
    def accept(self, identity: EngineIdentity) -> None:
        """The gate passed this engine identity: the worker takes traffic on connections that confirm it."""
        joining = self._verified is None
        if joining:
            log.info("worker %s (%s) is in rotation", self.url, self.role)
        self._verified = identity
        self._out_reason = ""
        if joining:
            if self._on_join is not None:  # maybe another engine process than before: nothing of its cache is known
                self._on_join(self)
            self._capacity_changed()

    def refuse(self, reason: str) -> None:
        """The gate refused the worker (or could not read it): no traffic until it passes again."""
        if self._verified is not None:
            log.warning("worker %s (%s) leaves rotation: %s", self.url, self.role, reason)
        self._verified = None
        self._out_reason = reason

    def mark_unreachable(self, reason: str) -> None:
        """A connection for a request failed: the engine may be restarting; out until read and judged again."""
        self._drop_verification(reason)

    def mark_changed(self, reason: str) -> None:
        """A new connection found another engine identity than the verified one (a restart)."""
        self._drop_verification(reason)

    def record_health(self, ok: bool, *, failure_threshold: int, success_threshold: int) -> None:
        """One telemetry read's outcome; health flips after that many consecutive failures or successes."""
        if ok:
            self._failures = 0
            self._successes += 1
            if not self._healthy and self._successes >= success_threshold:
                self._healthy = True
                log.info("worker %s is healthy again", self.url)
                self._capacity_changed()
        else:
            self._successes = 0
            self._failures += 1
            if self._healthy and self._failures >= failure_threshold:
                self._healthy = False
                log.warning("worker %s is unhealthy", self.url)

    def record_outcome(self, ok: bool, ticket: Ticket) -> None:
        """What one request's leg on this engine said about it (see routing.breaker for what counts)."""
        before = self._breaker.state
        self._breaker.record(ok, ticket)
        after = self._breaker.state
        if after is not before:
            log_level = logging.WARNING if after is BreakerState.OPEN else logging.INFO
            log.log(log_level, "worker %s (%s): circuit breaker %s", self.url, self.role, after.value)

    def reconfigure(self, *, breaker: BreakerSpec, max_inflight: int | None) -> None:
        """New limits from a reloaded configuration (the breaker keeps its state, with the new thresholds)."""
        self._breaker.reconfigure(breaker)
        self._max_inflight = max_inflight
        self._capacity_changed()

    def note_checks(self, outcomes: Iterable[CheckOutcome]) -> None:
        self._checks = tuple(outcomes)

    def note_fleet_load(self, elsewhere: int) -> None:
        self._in_flight_elsewhere = max(0, elsewhere)

    def record_engine_load(self, load: EngineLoad | int) -> None:
        self._engine_load = (time.monotonic(), EngineLoad(load) if isinstance(load, int) else load)

    def on_join(self, callback: Callable[[Worker], None]) -> None:
        """`callback(worker)` runs whenever the worker (re)joins rotation, before it takes a request."""
        self._on_join = callback

    def drain(self) -> None:
        """No new requests; those in flight finish."""
        if not self._draining:
            log.info("worker %s (%s) is draining (%d in flight)", self.url, self.role, self._in_flight)
        self._draining = True

    def on_capacity(self, callback: Callable[[Worker], None]) -> None:
        """`callback(worker)` runs whenever the worker may take one more request than before: a request on it
        ended, it joined rotation, it is healthy again, its limit changed (a waiting request may go to it)."""
        self._on_capacity = callback

    def _capacity_changed(self) -> None:
        if self._on_capacity is not None:
            self._on_capacity(self)

    def on_needs_verification(self, callback: Callable[[Worker], None]) -> None:
        """`callback(worker)` runs whenever the worker drops out pending re-verification (the monitor reads it)."""
        self._on_needs_verification = callback

    @contextmanager
    def load(self) -> Iterator[Ticket]:
        """Counts one request on this worker for as long as the block runs."""
        ticket = self.begin_request()
        try:
            yield ticket
        finally:
            self.end_request(ticket)

    def begin_request(self, *, reserve_tokens: int = 0, prefill_tokens: int = 0) -> Ticket:
        """One more request on this worker (while the breaker is half-open, it is the probe), which may hold
        `reserve_tokens` of its KV and leaves it `prefill_tokens` to compute (until `end_prefill`)."""
        self._in_flight += 1
        self._reserved_tokens += reserve_tokens
        self._prefill_backlog += prefill_tokens
        return self._breaker.on_dispatch()

    def end_prefill(self, prefill_tokens: int) -> None:
        self._prefill_backlog -= prefill_tokens

    def end_request(self, ticket: Ticket, *, reserve_tokens: int = 0) -> None:
        self._in_flight -= 1
        self._reserved_tokens -= reserve_tokens
        self._breaker.release(ticket)
        self._capacity_changed()

    def _drop_verification(self, reason: str) -> None:
        was_verified = self._verified is not None
        self.refuse(reason)
        if was_verified and self._on_needs_verification is not None:
            self._on_needs_verification(self)
