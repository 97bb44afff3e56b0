"""The token-bucket arithmetic, for the in-memory state (the Redis state runs the same rule in Lua)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Bucket:
    level: float
    at: float  # when `level` was last brought up to date (seconds)

    def refill(self, per_min: int, now: float) -> float:
        """Bring the level up to `now` (capped at `per_min`) and return it."""
        self.level = min(float(per_min), self.level + max(0.0, now - self.at) * per_min / 60.0)
        self.at = now
        return self.level


def empty(level: float) -> bool:
    """Less than one whole unit left (the bucket refills continuously: a sliver is not room for anything)."""
    return level < 1.0


def wait_s(level: float, per_min: int) -> float:
    """How long until an empty bucket at `level` holds one whole unit again."""
    return max(0.0, 1.0 - level) * 60.0 / per_min + 0.001
