from __future__ import annotations

import random
from collections.abc import Sequence

from routing.policies.base import RouteKey
from routing.workers import Worker


class RandomChoice:
    """A worker drawn uniformly."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        return self._rng.choice(workers) if workers else None
