from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import RouteKey
from routing.workers import Worker


class LeastOutstanding:
    """The worker with the fewest requests in flight through the gateway fleet (this replica's own count, plus the
    other replicas' as of the last fleet sync); ties go round robin, so a burst on an idle pool still spreads."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        if not workers:
            return None
        self._next += 1
        n = len(workers)
        return min((workers[(self._next + i) % n] for i in range(n)), key=lambda w: w.fleet_in_flight)
