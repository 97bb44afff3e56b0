"""A hostile review of the cross-tenant fix (attack21): tenant A, who controls its own prompts and their timing and
reads its predicted match (kvgate_route_cached_tokens_predicted on the unauthenticated /metrics, or which prefill it
is routed to, in its latency), must learn nothing of whether tenant B sent a prompt."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from routing.policies import RouteKey
from routing.policies.cache_aware import CacheAware
from routing.pools import Lease, WorkerPair
from routing.prefix_index import CacheIndex, CacheMode
from routing.workers import Worker
from tests.routing.prefix_index.kv_events_modes import index_in_mode, kv_events_mode  # noqa: F401
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
    seen = {b_sent: _a_probes_after_b(index_in_mode(page_size=16, capacity_tokens=100_000), b_sent)
            for b_sent in (False, True)}
    assert seen[True] == seen[False], f"A's predicted match reads B's traffic: {seen}"


def test_whether_b_sent_a_prefix_does_not_change_where_a_is_routed() -> None:
    """The same oracle through the pick: A's probe goes to the prefill that holds A's copy in one world and to
    another one in the other, and a cold prefill answers visibly slower (the whole prompt prefilled)."""
    picked = {}
    for b_sent in (False, True):
        workers = prefills(2, page_size=16)
        for worker in workers:
            worker.cache_index = index_in_mode(page_size=16, capacity_tokens=100_000)
        holder = workers[0]
        assert holder.cache_index is not None
        _a_probes_after_b(holder.cache_index, b_sent)
        probe = prompt(SECRET, "tenant-a")
        chosen = CacheAware().pick(workers, RouteKey(prompt=probe))
        picked[b_sent] = (chosen is holder, probe.predicted_cached)
    assert picked[True] == picked[False], f"A's routing reads B's traffic: {picked}"


class _LruEngine:
    """An LRU radix cache of whole prompts (no two share a prefix unless equal), one copy per (namespace, prompt),
    publishing SGLang's blind page hashes: what kvgate's index is fed in the attacker's games below."""

    def __init__(self, index: CacheIndex, capacity: int) -> None:
        self.index, self.capacity = index, capacity
        self.rank = index.engine_view()
        index.mode = CacheMode.EXACT
        self.held: OrderedDict[tuple[str, tuple[int, ...]], None] = OrderedDict()

    def send(self, ids: list[int], namespace: str) -> None:
        self.index.record(prompt(ids, namespace))
        entry = (namespace, tuple(ids))
        if entry in self.held:
            self.held.move_to_end(entry)
            return
        self.held[entry] = None
        self.rank.store(sglang_page_hashes(ids, 16), None, ids, 16)
        while len(self.held) > self.capacity:
            (_, victim), _ = self.held.popitem(last=False)
            self.rank.remove(sglang_page_hashes(list(victim), 16))


@pytest.mark.parametrize("tight", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_no_ordering_of_a_and_b_lets_a_tell_whether_b_sent_its_prefix(seed: int, tight: bool) -> None:
    """A sends SECRET and junk in any order and at any time; B sends SECRET in one world and an unrelated prompt of
    the same length in the other, at the same moments (the engine's pressure is the same). A's copies fare the same
    in both engines, so every prediction A can read must be the same too."""
    rng = random.Random(seed)
    junk = [list(range(20_000 + 400 * i, 20_000 + 400 * i + 320)) for i in range(4)]
    steps = [(rng.random() < 0.5, rng.randrange(5)) for _ in range(60)]
    capacity = rng.randrange(2, 6)
    readings = []
    for b_sends_secret in (False, True):
        # tight: the pool kvgate is told is the engine's own, so the index's bounded memory forgets as it goes
        engine = _LruEngine(index_in_mode(page_size=16, capacity_tokens=capacity * 320 if tight else 100_000), capacity)
        seen = []
        for is_a, choice in steps:
            if is_a:
                engine.send(SECRET if choice == 4 else junk[choice], "tenant-a")
            else:
                engine.send((SECRET if b_sends_secret else OTHER) if choice >= 3 else junk[choice], "tenant-b")
            seen.append(tuple(engine.index.match(prompt(ids, "tenant-a")) for ids in (SECRET, *junk)))
        readings.append(seen)
    assert readings[0] == readings[1]


def _liar_share(liar_clears: bool) -> float:
    """After a warm-up, 16 growing conversations (10 turns of 300 tokens each, interleaved, 8 in flight) over 4 prefills, the first
    of which, when `liar_clears`, publishes AllBlocksCleared (or restarts its sequence) after every batch: the
    subscriber calls `forget_sent` each time, so that prefill's index never holds anything."""
    pool, policy = prefills(4, page_size=16), CacheAware()
    liar = pool[0]
    decode = prefills(1)[0]
    for past in range(300):  # a gateway that has run a while: every index near its pool (100,000 tokens)
        policy.pick(pool, RouteKey(prompt=prompt(list(range(past * 2000, past * 2000 + 1500)), "tenant-x")))
    conversations = {user: [user] * 16 for user in range(16)}
    in_flight: list[Lease] = []
    picks: list[Worker] = []
    for turn in range(10):
        for user, ids in conversations.items():
            ids.extend(range(10_000 * user + 300 * turn, 10_000 * user + 300 * turn + 300))
            asked = prompt(list(ids), f"tenant-{user % 4}")
            chosen = policy.pick(pool, RouteKey(prompt=asked))
            assert chosen is not None
            picks.append(chosen)
            in_flight.append(Lease(WorkerPair(chosen, decode), asked))
            if len(in_flight) > 8:
                in_flight.pop(0).release()
            if liar_clears and liar.cache_index is not None:
                liar.cache_index.forget_sent()  # what _engine_emptied does on AllBlocksCleared / a sequence restart
    for lease in in_flight:
        lease.release()
    return sum(1 for worker in picks if worker is liar) / len(picks)


def test_an_engine_that_keeps_reporting_its_cache_cleared_cannot_draw_most_of_the_traffic() -> None:
    """SPREAD_WEIGHT charges each prefill half the tokens its index holds beyond the emptiest one's, up to half a
    pool; an engine whose events keep saying its cache was cleared is always the emptiest, so every other prefill
    pays that penalty against it, and it draws every conversation whose cached part is under half of what the others
    hold (and sees every tenant's prompts)."""
    honest = _liar_share(False)
    lying = _liar_share(True)
    assert lying <= max(0.5, 2 * honest), f"a prefill claiming an empty cache drew {lying:.0%} (honest: {honest:.0%})"
