from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import RouteKey
from routing.policies.least_outstanding import LeastOutstanding
from routing.prefix_index import PromptTokens
from routing.workers import Worker


# A prompt whose best match covers less than this share of it is placed for balance, not for its match: sending
# every conversation that shares only a short system prompt to one engine would fill that engine's cache and leave
# the others' empty (sglang-router's cache_threshold, 0.5 by default, draws the same line).
MIN_MATCH_SHARE = 0.5


class CacheAware:
    """Where a prompt's KV already is, unless waiting there costs more than computing it elsewhere.

    With a match covering at least MIN_MATCH_SHARE of the prompt somewhere: the prefill that would finish this
    prompt's prefill soonest, i.e. the least uncached prompt tokens it still has queued from this gateway
    (`Worker.prefill_backlog`) plus the part of this prompt it does not hold. So the longest match wins while loads
    are even, and a hot prefix spills to another engine once queueing there would cost more than computing the
    prefix again. Otherwise (nothing worth following): the least queued work, then the emptiest index (the most
    room for a new conversation), then the fewest requests in flight (other replicas' included). Full ties rotate.
    The pick is recorded in the worker's index: its prefill will hold the prompt next. Requests without token ids
    go to the least loaded."""

    def __init__(self) -> None:
        self._fallback = LeastOutstanding()
        self._next = 0

    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        prompt = key.prompt
        if prompt is None or not workers:
            return self._fallback.pick(workers, key)
        self._next += 1
        n = len(workers)
        rotated = [workers[(self._next + i) % n] for i in range(n)]  # full ties spread as round robin
        matches = [_match(worker, prompt) for worker in rotated]
        if max(matches) >= MIN_MATCH_SHARE * prompt.tokens > 0:
            ranks = [(w.prefill_backlog + prompt.tokens - cached, -cached, w.fleet_in_flight)
                     for w, cached in zip(rotated, matches)]
        else:
            ranks = [(w.prefill_backlog, _index_fill(w), w.fleet_in_flight) for w in rotated]
        at = min(range(n), key=ranks.__getitem__)
        best = rotated[at]
        prompt.predicted_cached = matches[at]
        if best.cache_index is not None:
            best.cache_index.record(prompt)
        return best



def _match(worker: Worker, prompt: PromptTokens) -> int:
    index = worker.cache_index
    return min(index.match(prompt), prompt.tokens) if index is not None else 0


def _index_fill(worker: Worker) -> float:
    index = worker.cache_index
    return index.sent_blocks / index.capacity_blocks if index is not None else 0.0
