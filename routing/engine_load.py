"""What an engine says of its own load (`/v1/loads`, SGLang 0.5.8+; the deprecated `/get_load`, gone in 0.5.23)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineLoad:
    tokens: int  # KV tokens in use plus tokens waiting to be prefilled
    used_tokens: int | None = None  # KV tokens in use (`num_used_tokens`), where the engine reports it


def load_from_v1_loads(report: Any) -> EngineLoad | None:
    """KV tokens in use plus tokens waiting, summed over data-parallel ranks."""
    loads = report.get("loads") if isinstance(report, dict) else None
    if not isinstance(loads, list) or not loads:
        return None
    total = used = 0
    for rank in loads:
        if not isinstance(rank, dict) or not _is_count(rank.get("num_used_tokens")):
            return None
        waiting = rank.get("num_waiting_uncached_tokens")
        used += rank["num_used_tokens"]
        total += rank["num_used_tokens"] + (waiting if _is_count(waiting) else 0)
    return EngineLoad(total, used)


def load_from_get_load(report: Any) -> EngineLoad | None:
    """`num_tokens` summed over ranks, as sglang-router's LoadMonitor reads it."""
    if not isinstance(report, list) or not report:
        return None
    values: list[int] = [rank["num_tokens"] for rank in report
                         if isinstance(rank, dict) and _is_count(rank.get("num_tokens"))]
    if len(values) != len(report):
        return None
    return EngineLoad(sum(values))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
