"""A second hostile review of the send-order attribution (attack2): games tenant A plays alone, reading
kvgate_route_cached_tokens_predicted or where it is routed, that tell whether tenant B sent A's prefix; and what a
lying prefill can draw."""

from __future__ import annotations

from routing.policies import RouteKey
from routing.policies.cache_aware import CacheAware
from routing.pools import Lease, WorkerPair
from routing.prefix_index import CacheIndex, CacheMode
from routing.workers import Worker
from tests.routing.prefix_index.test_cache_aware import prefills, prompt, sglang_page_hashes

SECRET = list(range(200, 520))  # 320 tokens, 10 blocks of 32
OTHER = list(range(9000, 9320))
JUNK = list(range(30_000, 30_320))


def _a_pipelines_a_refresh(b_sent: bool) -> int:
    """An LRU engine that holds 2 prompts, its events a scheduler step behind kvgate's records (as SGLang's are).
    A sends SECRET, B sends SECRET or OTHER; then A sends JUNK and, while JUNK is in flight, SECRET again (both are
    A's own requests: A controls this race alone). Prefilling JUNK evicts the LRU entry, A's old SECRET copy, and
    that BlockRemoved arrives after kvgate recorded A's re-send. A then probes SECRET."""
    index = CacheIndex(page_size=16, capacity_tokens=100_000)
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    secret, other, junk = (sglang_page_hashes(ids, 16) for ids in (SECRET, OTHER, JUNK))
    index.record(prompt(SECRET, "tenant-a"))
    rank.store(secret, None, SECRET, 16)
    index.record(prompt(SECRET if b_sent else OTHER, "tenant-b"))
    rank.store(secret if b_sent else other, None, SECRET if b_sent else OTHER, 16)
    index.record(prompt(JUNK, "tenant-a"))
    index.record(prompt(SECRET, "tenant-a"))  # in flight behind JUNK
    rank.store(junk, None, JUNK, 16)  # the engine prefills JUNK ...
    rank.remove(secret)  # ... evicting A's old copy of SECRET (the LRU entry in both worlds)
    return index.match(prompt(SECRET, "tenant-a"))


def test_a_refresh_in_flight_behind_as_own_request_does_not_read_bs_traffic() -> None:
    seen = {b_sent: _a_pipelines_a_refresh(b_sent) for b_sent in (False, True)}
    assert seen[True] == seen[False], f"A's predicted match reads B's traffic: {seen}"


def _liar_share_at_low_load(liar_pool_tokens: int | None) -> float:
    """Requests one at a time (each prefilled before the next arrives: no backlog), 16 growing conversations of
    300-token turns over 4 prefills; the first prefill's /server_info claims a pool of `liar_pool_tokens` (None: the
    same as the others')."""
    pool, policy = prefills(4, page_size=16), CacheAware()
    liar = pool[0]
    if liar_pool_tokens is not None:
        liar.cache_index = CacheIndex(page_size=16, capacity_tokens=liar_pool_tokens)
    decode = prefills(1)[0]
    for past in range(300):  # a gateway that has run a while
        asked = prompt(list(range(past * 2000, past * 2000 + 1500)), "tenant-x")
        chosen = policy.pick(pool, RouteKey(prompt=asked))
        assert chosen is not None
        Lease(WorkerPair(chosen, decode), asked).release()
    conversations = {user: [user] * 16 for user in range(16)}
    picks: list[Worker] = []
    for turn in range(10):
        for user, ids in conversations.items():
            ids.extend(range(10_000 * user + 300 * turn, 10_000 * user + 300 * turn + 300))
            asked = prompt(list(ids), f"tenant-{user % 4}")
            chosen = policy.pick(pool, RouteKey(prompt=asked))
            assert chosen is not None
            picks.append(chosen)
            Lease(WorkerPair(chosen, decode), asked).release()
    return sum(1 for worker in picks if worker is liar) / len(picks)


def test_a_prefill_claiming_a_tiny_pool_cannot_draw_most_of_the_traffic_at_low_load() -> None:
    honest = _liar_share_at_low_load(None)
    lying = _liar_share_at_low_load(64)  # two blocks: its index is always the emptiest, and never holds a turn
    assert lying <= max(0.5, 2 * honest), f"a prefill claiming a tiny pool drew {lying:.0%} (honest: {honest:.0%})"
