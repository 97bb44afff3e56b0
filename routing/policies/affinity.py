from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import RouteKey
from routing.policies.hashing import first_ranked, ranked
from routing.policies.least_outstanding import LeastOutstanding
from routing.workers import Worker

# A preferred worker is skipped when it has this many more requests in flight than the least loaded one, and
# this fraction more: affinity saves a prefill, it must not pile a hot prefix onto one engine.
LOAD_GUARD_ABS = 8
LOAD_GUARD_REL = 1.5


def _within_guard(worker: Worker, least: int) -> bool:
    load = worker.fleet_in_flight
    return load - least <= LOAD_GUARD_ABS or load <= least * LOAD_GUARD_REL


class _Affinity:
    """Sticky by a key (rendezvous hashing), with a load guard; requests without a key go to the least loaded."""

    def __init__(self) -> None:
        self._fallback = LeastOutstanding()

    def _key(self, key: RouteKey) -> int | None:
        raise NotImplementedError

    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        value = self._key(key)
        if value is None or len(workers) < 2:
            return self._fallback.pick(workers, key)
        least = min(w.fleet_in_flight for w in workers)
        preferred = first_ranked(workers, value)
        if _within_guard(preferred, least):
            return preferred
        for worker in ranked(workers, value):  # the preferred one is overloaded: the next in this key's ranking
            if _within_guard(worker, least):
                return worker
        return self._fallback.pick(workers, key)  # unreachable: the least loaded always passes


class PrefixAffinity(_Affinity):
    """Prompts that start alike (the same first token ids and cache_salt) go to the same worker, where SGLang's
    radix cache may already hold their KV."""

    def _key(self, key: RouteKey) -> int | None:
        return key.prefix


class SessionAffinity(_Affinity):
    """Requests carrying the same affinity header value go to the same worker."""

    def _key(self, key: RouteKey) -> int | None:
        return key.session
