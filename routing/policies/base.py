from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from routing.workers import Worker


class Policy(Protocol):
    def pick(self, workers: Sequence[Worker]) -> Worker | None:
        """One of `workers` (all usable), or None when the sequence is empty."""
