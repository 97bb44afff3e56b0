"""Plain settings routing runs on. The gateway builds them from its configuration; routing knows no YAML."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from routing.workers import WorkerSpec


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


@dataclass(frozen=True, slots=True)
class HealthSpec:
    """How often workers are read, and how many reads in a row flip their health."""

    interval_s: float
    timeout_s: float
    failure_threshold: int
    success_threshold: int
