from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import RouteKey
from routing.policies.least_outstanding import LeastOutstanding
from routing.prefix_index import PromptTokens
from routing.workers import Worker

# How much one token more in a prefill's cache than in the emptiest one's weighs against a token of prefill saved.
# Without it, every conversation that shares a short system prompt would follow the first engine that held it, fill
# that engine's cache and leave the others' empty (then thrash): a new conversation saves only the system prompt
# and goes where there is room; a continuing one saves its whole history and stays.
SPREAD_WEIGHT = 0.5


class CacheAware:
    """Where a prompt's KV already is, unless waiting there, or crowding that cache, costs more than computing it
    elsewhere.

    Each prefill is scored in prompt tokens: its queued uncached work from this gateway (`Worker.prefill_backlog`,
    a GPU prefills one batch at a time), plus the part of this prompt it does not hold, plus SPREAD_WEIGHT times the
    tokens its cache index holds beyond the emptiest one's, at most the prompt's tokens (an index that claims to be
    empty must not draw the traffic: see `pick`). The lowest score wins; ties go to the longer match, then
    the fewer requests in flight (other replicas' included), then round robin. So the longest match wins while loads
    are even, a hot prefix spills once queueing costs more than recomputing it, and with nothing cached it is the
    least loaded engine by work. The pick is recorded in the worker's index: its prefill will hold the prompt next.
    Requests without token ids go to the least loaded."""

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
        held = [_held_tokens(worker) for worker in rotated]
        emptiest = min(held)
        # The spread term is capped at the prompt's own tokens: a prefill whose index claims to be empty (its events
        # keep reporting its cache cleared, or its /server_info a tiny pool) wins a cold prompt by at most
        # SPREAD_WEIGHT of that prompt's tokens of queued work, so load, not its claim, decides among cold prefills.
        spread = prompt.tokens
        ranks = [(w.prefill_backlog + prompt.tokens - cached + SPREAD_WEIGHT * min(tokens - emptiest, spread),
                  -cached, w.fleet_in_flight) for w, cached, tokens in zip(rotated, matches, held)]
        at = min(range(n), key=ranks.__getitem__)
        best = rotated[at]
        prompt.predicted_cached = matches[at]
        if best.cache_index is not None:
            best.cache_index.record(prompt)
        return best


def _match(worker: Worker, prompt: PromptTokens) -> int:
    index = worker.cache_index
    return min(index.match(prompt), prompt.tokens) if index is not None else 0


def _held_tokens(worker: Worker) -> int:
    index = worker.cache_index
    return index.sent_blocks * index.block_tokens if index is not None else 0
