from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import RouteKey
from routing.workers import Worker


class RoundRobin:
    """Each worker in turn."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        if not workers:
            return None
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker
