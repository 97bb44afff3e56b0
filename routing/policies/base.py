from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from routing.prefix_index import PromptTokens
from routing.workers import Worker


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What a policy may know of one request: stable hashes of it, and for the cache- and KV-aware policies its
    token ids and sizes (never its text)."""

    prefix: int | None = None  # hash of the prompt's first token ids, with the request's cache_salt
    session: int | None = None  # hash of the affinity header's value
    prompt: PromptTokens | None = None  # cache_aware, kv_headroom


NO_KEY = RouteKey()


class Policy(Protocol):
    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        """One of `workers` (all in rotation and with room), or None when the sequence is empty."""
