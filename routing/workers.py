"""Workers: one SGLang engine each. A worker owns its state and its transitions; others ask, never assign.

A worker takes traffic only while it is *verified* (the KV-pool gate passed the engine identity it last read) and
*healthy* (its telemetry reads succeed). Any sign that the engine may have changed takes it out of rotation until
the monitor has read and judged it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from routing.engines.identity import EngineIdentity

Role = Literal["prefill", "decode"]

log = logging.getLogger("kvgate.workers")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    url: str
    role: Role
    bootstrap_port: int | None = None


class Worker:
    """One engine: where it is, what the gate verified about it, whether it is healthy, what it is doing."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.url = spec.url
        self.role: Role = spec.role
        self.bootstrap_port = spec.bootstrap_port
        host = urlsplit(spec.url).hostname or ""
        # SGLang expects a bracketed IPv6 literal in bootstrap_host, as its own router sends it.
        self.bootstrap_host = f"[{host}]" if ":" in host else host
        self._verified: EngineIdentity | None = None
        self._healthy = True
        self._out_reason = "not verified yet"
        self._in_flight = 0
        self._failures = 0
        self._successes = 0
        self._on_needs_verification: Callable[[Worker], None] | None = None

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
        return self._healthy and self._verified is not None

    @property
    def out_of_rotation_reason(self) -> str:
        if self._verified is None:
            return self._out_reason
        return "" if self._healthy else "unhealthy"

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ── transitions ─────────────────────────────────────────────────────────────────────────────────────────
    def accept(self, identity: EngineIdentity) -> None:
        """The gate passed this engine identity: the worker takes traffic on connections that confirm it."""
        if self._verified is None:
            log.info("worker %s (%s) is in rotation", self.url, self.role)
        self._verified = identity
        self._out_reason = ""

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
        else:
            self._successes = 0
            self._failures += 1
            if self._healthy and self._failures >= failure_threshold:
                self._healthy = False
                log.warning("worker %s is unhealthy", self.url)

    def on_needs_verification(self, callback: Callable[[Worker], None]) -> None:
        """`callback(worker)` runs whenever the worker drops out pending re-verification (the monitor reads it)."""
        self._on_needs_verification = callback

    @contextmanager
    def load(self) -> Iterator[None]:
        """Counts one request on this worker for as long as the block runs."""
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    def _drop_verification(self, reason: str) -> None:
        was_verified = self._verified is not None
        self.refuse(reason)
        if was_verified and self._on_needs_verification is not None:
            self._on_needs_verification(self)
