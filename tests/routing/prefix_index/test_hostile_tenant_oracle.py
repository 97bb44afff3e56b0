"""A hostile review of the cross-tenant fix (attack21): tenant A, who controls its own prompts and their timing and
reads its predicted match (kvgate_route_cached_tokens_predicted on the unauthenticated /metrics, or which prefill it
is routed to, in its latency), must learn nothing of whether tenant B sent a prompt."""

from __future__ import annotations

from routing.policies import RouteKey
from routing.policies.cache_aware import CacheAware
from routing.prefix_index import CacheIndex, CacheMode
from tests.routing.prefix_index.test_cache_aware import prefills, prompt, sglang_page_hashes

SECRET = list(range(200, 520))  # 320 tokens: B's confidential prefix (a document, a system prompt), or not
OTHER = list(range(9000, 9320))  # an unrelated prompt, nobody's secret


def _a_probes_after_b(index: CacheIndex, b_sent: bool) -> int:
    """The engine is an LRU radix cache with one namespace per tenant and blind published hashes. B may have sent
    SECRET a while ago (its copy is the oldest in the cache); otherwise the oldest entry is some unrelated prompt.
    A sends SECRET (its copy is the newest), the engine then evicts its least recently used entry to make room
    (whatever it is), and A sends SECRET again at once: its own copy, the most recently used, is certainly still
    held, so an honest prediction is the whole prefix in both worlds."""
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    secret, other = sglang_page_hashes(SECRET, 16), sglang_page_hashes(OTHER, 16)
    if b_sent:
        index.record(prompt(SECRET, "tenant-b"))
        rank.store(secret, None, SECRET, 16)  # B's copy
    else:
        rank.store(other, None, OTHER, 16)  # the oldest entry is someone's unrelated prompt
    index.record(prompt(SECRET, "tenant-a"))
    rank.store(secret, None, SECRET, 16)  # A's copy: the same published hashes (refs 2 with B's)
    rank.remove(secret if b_sent else other)  # the engine's LRU victim: B's old copy, or the unrelated prompt
    return index.match(prompt(SECRET, "tenant-a"))


def test_whether_b_sent_a_prefix_does_not_change_as_predicted_match() -> None:
    seen = {b_sent: _a_probes_after_b(CacheIndex(page_size=16, capacity_tokens=100_000), b_sent)
            for b_sent in (False, True)}
    assert seen[True] == seen[False], f"A's predicted match reads B's traffic: {seen}"


def test_whether_b_sent_a_prefix_does_not_change_where_a_is_routed() -> None:
    """The same oracle through the pick: A's probe goes to the prefill that holds A's copy in one world and to
    another one in the other, and a cold prefill answers visibly slower (the whole prompt prefilled)."""
    picked = {}
    for b_sent in (False, True):
        workers = prefills(2, page_size=16)
        for worker in workers:
            worker.cache_index = CacheIndex(page_size=16, capacity_tokens=100_000)
        holder = workers[0]
        assert holder.cache_index is not None
        _a_probes_after_b(holder.cache_index, b_sent)
        probe = prompt(SECRET, "tenant-a")
        chosen = CacheAware().pick(workers, RouteKey(prompt=probe))
        picked[b_sent] = (chosen is holder, probe.predicted_cached)
    assert picked[True] == picked[False], f"A's routing reads B's traffic: {picked}"
