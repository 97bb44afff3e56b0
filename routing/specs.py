"""Plain settings routing runs on. The gateway builds them from its configuration; routing knows no YAML."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from routing.breaker import BreakerSpec
from routing.deployment_checks import CheckPolicy
from routing.workers import WorkerSpec


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """Backpressure: requests in flight per worker (through this gateway), and the bounded wait when all are full."""

    max_inflight_per_worker: int | None = 1024
    max_queue: int = 1024
    queue_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model as the KV-pool gate judges it."""

    name: str
    context_length: int
    configured_prompt_limit: int  # min(max_prompt_tokens, context_length - 1)
    on_pool_mismatch: Literal["refuse", "clamp"]
    min_engine_version: str
    on_old_engine: Literal["warn", "refuse"]
    prefill: tuple[WorkerSpec, ...]
    decode: tuple[WorkerSpec, ...]
    limits: PoolLimits = PoolLimits()
    breaker: BreakerSpec = BreakerSpec()
    checks: CheckPolicy = CheckPolicy()


@dataclass(frozen=True, slots=True)
class HealthSpec:
    """How often workers are read, and how many reads in a row flip their health."""

    interval_s: float
    timeout_s: float
    failure_threshold: int
    success_threshold: int
    path: str = "/server_info"  # any other path is also fetched, and must answer 2xx
