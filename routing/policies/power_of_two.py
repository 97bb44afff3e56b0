from __future__ import annotations

import random
from collections.abc import Sequence

from routing.policies.base import RouteKey
from routing.workers import Worker


class PowerOfTwo:
    """Two workers drawn at random, the less loaded one taken (Mitzenmacher's two choices).

    Load is the engine's own (KV tokens in use or queued, polled from `/v1/loads` or `/get_load`) when both readings
    are fresh, else the gateway's in-flight count: a stale reading is not trusted (sglang-router keeps using its
    last one, and falls to random on 0.5.23, which has no `/get_load`)."""

    def __init__(self, max_age_s: float, rng: random.Random | None = None) -> None:
        self._max_age_s = max_age_s
        self._rng = rng or random.Random()

    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        if len(workers) < 2:
            return workers[0] if workers else None
        a, b = self._rng.sample(workers, 2)
        load_a, load_b = a.engine_load(self._max_age_s), b.engine_load(self._max_age_s)
        if load_a is None or load_b is None or load_a == load_b:
            load_a, load_b = a.fleet_in_flight, b.fleet_in_flight
        return a if load_a <= load_b else b
