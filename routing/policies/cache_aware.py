from __future__ import annotations

import weakref
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
# How much of what a prefill was sent still counts toward its share, per pick: the spread term weighs the prompt
# tokens each prefill was sent lately (about the last 256 picks), as this gateway itself counted them, never what its
# index holds, which an engine's claims decide (a tiny pool, a cache reported cleared: always the emptiest index).
ROUTED_DECAY = 1 - 1 / 256


class CacheAware:
    """Where a prompt's KV already is, unless waiting there, or crowding that cache, costs more than computing it
    elsewhere.

    Each prefill is scored in prompt tokens: its queued uncached work from this gateway (`Worker.prefill_backlog`,
    a GPU prefills one batch at a time), plus the part of this prompt it does not hold, plus SPREAD_WEIGHT times the
    prompt tokens it was sent lately beyond the least sent one's (ROUTED_DECAY), at most the prompt's tokens (an
    engine's claims must not draw the traffic: see `pick`). The lowest score wins; ties go to the longer match, then
    the fewer requests in flight (other replicas' included), then round robin. So the longest match wins while loads
    are even, a hot prefix spills once queueing costs more than recomputing it, and with nothing cached it is the
    least loaded engine by work. The pick is recorded in the worker's index: its prefill will hold the prompt next.
    Requests without token ids go to the least loaded."""

    def __init__(self) -> None:
        self._fallback = LeastOutstanding()
        self._next = 0
        # per prefill: the prompt tokens sent there, decayed, and the pick that was counted at
        self._routed: weakref.WeakKeyDictionary[Worker, tuple[float, int]] = weakref.WeakKeyDictionary()

    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        prompt = key.prompt
        if prompt is None or not workers:
            return self._fallback.pick(workers, key)
        self._next += 1
        n = len(workers)
        rotated = [workers[(self._next + i) % n] for i in range(n)]  # full ties spread as round robin
        matches = [_match(worker, prompt) for worker in rotated]
        picks = self._next
        routed = self._routed
        held = [_decayed(routed.get(worker), picks) for worker in rotated]
        emptiest = min(held)
        # The spread term counts what this gateway sent each prefill lately, not what its index holds: an engine
        # whose events keep reporting its cache cleared, or whose /server_info claims a tiny pool, holds an empty
        # index and would win every cold prompt (at low load, every conversation: it never holds a turn). It is
        # capped at the prompt's own tokens, so a long history sent elsewhere does not outweigh load.
        spread = prompt.tokens
        ranks = [(w.prefill_backlog + prompt.tokens - cached + SPREAD_WEIGHT * min(tokens - emptiest, spread),
                  -cached, w.fleet_in_flight) for w, cached, tokens in zip(rotated, matches, held)]
        at = min(range(n), key=ranks.__getitem__)
        best = rotated[at]
        routed[best] = (held[at] + prompt.tokens, picks)
        prompt.predicted_cached = matches[at]
        if best.cache_index is not None:
            best.cache_index.record(prompt)
        return best


def _match(worker: Worker, prompt: PromptTokens) -> int:
    index = worker.cache_index
    return min(index.match(prompt), prompt.tokens) if index is not None else 0


def _decayed(routed: tuple[float, int] | None, now: int) -> float:
    if routed is None:
        return 0.0
    tokens, at = routed
    return tokens * ROUTED_DECAY ** (now - at)
