from __future__ import annotations

from collections.abc import Sequence

from routing.workers import Worker


class RoundRobin:
    """Each usable worker in turn."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, workers: Sequence[Worker]) -> Worker | None:
        if not workers:
            return None
        worker = workers[self._next % len(workers)]
        self._next += 1
        return worker
