"""A replica's part of a fleet-wide limit while it cannot reach the others (Redis down, `on_redis_down: open`)."""

from __future__ import annotations

from collections.abc import Iterable


def share(limit: int, replicas: Iterable[str], me: str) -> int:
    """`limit` split among the live replicas last seen (this one included): limit // n each, the remainder to the
    first replicas by id, so that the parts add up to the limit exactly (a part may be 0)."""
    live = sorted(set(replicas) | {me})
    whole, rest = divmod(limit, len(live))
    return whole + (1 if live.index(me) < rest else 0)


def seeded_level(level: float, at: float, per_min: int, part: int, now: float) -> float:
    """A fallback bucket of `part` a minute, started from the shared bucket's last known `level` (of `per_min`,
    read at `at`): this replica's part of what was left, refilled at its part's rate since, capped at `part`."""
    return min(float(part), level * part / per_min + max(0.0, now - at) * part / 60.0)
