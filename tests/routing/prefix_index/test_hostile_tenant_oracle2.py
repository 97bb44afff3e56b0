"""A second hostile review of the send-order attribution (attack2): games tenant A plays alone, reading
kvgate_route_cached_tokens_predicted or where it is routed, that tell whether tenant B sent A's prefix; and what a
lying prefill can draw."""

from __future__ import annotations

import random

import pytest

from routing.policies import RouteKey
from routing.policies.cache_aware import CacheAware
from routing.pools import Lease, WorkerPair
from routing.prefix_index import CacheIndex, CacheMode
from routing.workers import Worker
from tests.routing.prefix_index.kv_events_modes import index_in_mode, kv_events_mode  # noqa: F401
from tests.routing.prefix_index.test_cache_aware import prefills, prompt, sglang_page_hashes

PER_BLOCK_LEAKS = {
    "test_a_refresh_in_flight_behind_as_own_request_does_not_read_bs_traffic":
        "per_block: A's own request in flight reorders kvgate's record and the engine's eviction (README)",
    "test_tree_shaped_prompts_and_probes_of_any_length_do_not_read_bs_traffic":
        "per_block: with the engine's real pool the eviction marks' floor moves with B's content (README)",
}
PER_BLOCK_ONLY = {"test_a_block_charged_evicted_mid_prompt_ends_the_match_there"}

SECRET = list(range(200, 520))  # 320 tokens, 10 blocks of 32
OTHER = list(range(9000, 9320))
JUNK = list(range(30_000, 30_320))


def _a_pipelines_a_refresh(b_sent: bool) -> int:
    """An LRU engine that holds 2 prompts, its events a scheduler step behind kvgate's records (as SGLang's are).
    A sends SECRET, B sends SECRET or OTHER; then A sends JUNK and, while JUNK is in flight, SECRET again (both are
    A's own requests: A controls this race alone). Prefilling JUNK evicts the LRU entry, A's old SECRET copy, and
    that BlockRemoved arrives after kvgate recorded A's re-send. A then probes SECRET."""
    index = index_in_mode(page_size=16, capacity_tokens=100_000)
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
        liar.cache_index = index_in_mode(page_size=16, capacity_tokens=liar_pool_tokens)
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


class _RadixEngine:
    """SGLang's radix cache at block granularity: one tree per namespace (extra_key), a node per 32-token block,
    a send touches every node on its path (a parent's access time is never older than a child's), eviction takes the
    least recently used *leaf* not on the request's path, and the events are its blind page hashes, applied at once."""

    def __init__(self, index: CacheIndex, capacity_blocks: int) -> None:
        self.index, self.capacity = index, capacity_blocks
        self.rank = index.engine_view()
        index.mode = CacheMode.EXACT
        self.clock = 0
        self.nodes: dict[tuple[str, tuple[int, ...]], int] = {}  # (namespace, block-path) → last access

    def _pages(self, path: tuple[int, ...]) -> tuple[list[int], int | None]:
        hashes = sglang_page_hashes(list(path), 16)
        return hashes[-2:], (hashes[-3] if len(hashes) > 2 else None)

    def send(self, ids: list[int], namespace: str) -> None:
        self.index.record(prompt(ids, namespace))
        self.clock += 1
        paths = [tuple(ids[:32 * (i + 1)]) for i in range(len(ids) // 32)]
        missing = [p for p in paths if (namespace, p) not in self.nodes]
        for p in paths:
            if (namespace, p) in self.nodes:
                self.nodes[(namespace, p)] = self.clock
        on_path = {(namespace, p) for p in paths}
        while len(self.nodes) + len(missing) > self.capacity:
            leaves = [n for n in self.nodes if n not in on_path
                      and not any(m[0] == n[0] and len(m[1]) == len(n[1]) + 32 and m[1][:len(n[1])] == n[1]
                                  for m in self.nodes)]
            victim = min(leaves, key=lambda n: (self.nodes[n], -len(n[1])))
            del self.nodes[victim]
            self.rank.remove(self._pages(victim[1])[0])
        for p in missing:
            self.nodes[(namespace, p)] = self.clock
            pages, parent = self._pages(p)
            self.rank.store(pages, parent, list(p[-32:]), 16)


@pytest.mark.parametrize("tight", [False, True])
@pytest.mark.parametrize("seed", range(60))
def test_tree_shaped_prompts_and_probes_of_any_length_do_not_read_bs_traffic(seed: int, tight: bool) -> None:
    """A sends P+X, P+Z and P cut at any block; B sends P+Y in one world and Q+Y (Q: unrelated, P's size) in the
    other. Parent blocks are shared by A's prompts; SGLang evicts leaves first. `tight`: kvgate is told the engine's
    own pool, so the copies' order is forgotten as it goes (a half dropped raises the copies' floor): how soon
    depends on how many distinct blind blocks were sent, which B's content decides."""
    rng = random.Random(seed)
    p, q = list(range(200, 328)), list(range(5000, 5128))  # 4 blocks each
    x, y, z = list(range(600, 664)), list(range(700, 764)), list(range(800, 864))
    steps = [(rng.random() < 0.5, rng.randrange(6)) for _ in range(50)]
    capacity = rng.randrange(6, 20)
    readings = []
    for b_sends_p in (False, True):
        engine = _RadixEngine(index_in_mode(page_size=16, capacity_tokens=capacity * 32 if tight else 100_000),
                              capacity)
        seen = []
        for is_a, choice in steps:
            if is_a:
                engine.send([p + x, p + z, p[:32], p[:64], p[:96], x + z][choice], "tenant-a")
            else:
                engine.send(((p if b_sends_p else q) + y) if choice >= 3 else [x, z, y][choice], "tenant-b")
            seen.append(tuple(engine.index.match(prompt(ids, "tenant-a")) for ids in (p + x, p + z, p, x + z)))
        readings.append(seen)
    assert readings[0] == readings[1]


def _a_page_aligned_prompt(b_sent: bool) -> int:
    """SGLang's prefill caches the whole prompt (`cache_finished_req`: origin_input_ids + output_ids, less the last
    token generated), so a prompt of a whole number of blocks leaves its last block in the engine; kvgate records
    only the blocks a later request can hit (all but the last token). A sends P (3 blocks): kvgate knows 2 of them.
    B sends P+Y, or Q+Y of the same size. The engine evicts A's leaf (its third block, unknown to kvgate): charged
    to B's copy of it when B sent P. A sends P+X (its copy of block 3 now known), the engine then evicts B's third
    block, which is charged to A's copy."""
    index = index_in_mode(page_size=16, capacity_tokens=100_000)
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    p, q = list(range(200, 296)), list(range(5000, 5096))
    x, y = list(range(600, 664)), list(range(700, 764))
    bs = (p if b_sent else q) + y
    index.record(prompt(p, "tenant-a"))
    rank.store(sglang_page_hashes(p, 16), None, p, 16)
    index.record(prompt(bs, "tenant-b"))
    hashes = sglang_page_hashes(bs, 16)
    rank.store(hashes, None, bs, 16)
    a_hashes = sglang_page_hashes(p + x, 16)
    rank.remove(a_hashes[4:6])  # A's third block: the LRU leaf
    index.record(prompt(p + x, "tenant-a"))
    rank.store(a_hashes[4:], a_hashes[3], (p + x)[64:], 16)  # A's third block again, and X
    rank.remove(hashes[6:])  # B's leaf: Y, or Y
    rank.remove(hashes[4:6])  # then B's third block (of P, or of Q)
    return index.match(prompt(p + x, "tenant-a"))


def test_a_page_aligned_prompts_last_block_does_not_read_bs_traffic() -> None:
    seen = {b_sent: _a_page_aligned_prompt(b_sent) for b_sent in (False, True)}
    assert seen[True] == seen[False], f"A's predicted match reads B's traffic: {seen}"


def test_a_block_charged_evicted_mid_prompt_ends_the_match_there() -> None:
    """Attribution is per block, so the blocks a namespace is predicted to hold need not be a prefix: a block's
    eviction charged to A's copy while its children are not (another namespace's copy was the one evicted, or the
    engine's events for the child arrive later). The engine serves a prefix only, so A's match ends at the first
    block not counted; `prefix_depth`'s galloping assumes the held blocks are a prefix and skips the hole."""
    index = index_in_mode(page_size=16, capacity_tokens=100_000)
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    index.record(prompt(SECRET, "tenant-a"))
    hashes = sglang_page_hashes(SECRET, 16)
    rank.store(hashes, None, SECRET, 16)
    rank.remove(hashes[4:6])  # the third block's pages (its children's removals not, or not yet, reported)
    assert index.match(prompt(SECRET, "tenant-a")) == 64
