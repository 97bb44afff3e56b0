"""Cache-aware routing, in process: the cache index (what kvgate sent, what the engine reports), KV event decoding
for both SGLang shapes, and the cache_aware / kv_headroom picks."""

from __future__ import annotations

import hashlib
import random
import tracemalloc

import msgspec
import pytest

from routing.engine_load import EngineLoad
from routing.engines.identity import EngineIdentity
from routing.policies import RouteKey
from routing.policies.cache_aware import CacheAware
from routing.policies.kv_headroom import KvHeadroom
from routing.pools import Lease, WorkerPair
from routing.prefix_index import CacheIndex, CacheMode, PromptTokens
from routing.prefix_index.blocks import block_tokens_for, ids_to_bytes
from routing.prefix_index.events import (
    MAX_BATCH_BYTES,
    MAX_BATCH_EVENTS,
    MAX_BATCH_PAGES,
    Cleared,
    MalformedBatch,
    Removed,
    Stored,
    decode_batch,
)
from routing.prefix_index.index import KEY_BYTES, PAGE_BYTES, _Generations, prefix_depth
from routing.prefix_index.subscriber import connectable
from routing.workers import Worker, WorkerSpec

PREFILL = EngineIdentity(100_000, 99_000, 1, "0.5.8", "prefill", "glm-5", "/t", 131072)


def prompt(ids: list[int], namespace: str = "tenant-a", max_new: int = 0) -> PromptTokens:
    return PromptTokens(ids_to_bytes(ids), tokens=len(ids), namespace=namespace, max_new_tokens=max_new)


def prefills(n: int, page_size: int = 1) -> list[Worker]:
    made = []
    for i in range(n):
        worker = Worker(WorkerSpec(f"http://10.0.0.{i}:30000", "prefill"))
        worker.accept(PREFILL)
        worker.cache_index = CacheIndex(per_block_evictions=True, page_size=page_size, capacity_tokens=PREFILL.pool_tokens)
        made.append(worker)
    return made


def sglang_page_hashes(ids: list[int], page_size: int) -> list[int]:
    """SGLang 0.5.8 `compute_node_hash_values` + `hash_str_to_int64`, written from its source for the test."""
    out, prior = [], None
    for start in range(0, len(ids), page_size):
        digest = hashlib.sha256()
        if prior:
            digest.update(bytes.fromhex(prior))
        for token in ids[start:start + page_size]:
            digest.update(token.to_bytes(4, "little"))
        prior = digest.hexdigest()
        value = int(prior[:16], 16)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


# ── the index ─────────────────────────────────────────────────────────────────────────────────────────────────
def test_blocks_are_whole_pages_of_at_least_32_tokens() -> None:
    assert [block_tokens_for(p) for p in (1, 16, 32, 48, 64, 128)] == [32, 32, 32, 48, 64, 128]


def test_sent_prefix_matches_per_namespace_never_across() -> None:
    index = CacheIndex(per_block_evictions=True, page_size=1, capacity_tokens=100_000)
    conversation = list(range(1000, 1700))
    index.record(prompt(conversation))
    assert index.match(prompt(conversation)) == 672  # 699 tokens cacheable (the last is always computed): 21 blocks
    longer = conversation + list(range(5000, 5400))
    assert index.match(prompt(longer)) == 672  # the next turn reuses the whole earlier prompt
    diverged = conversation[:300] + [7] * 400
    assert index.match(prompt(diverged)) == 288  # up to the last whole block before the difference
    assert index.match(prompt(conversation, namespace="tenant-b")) == 0  # another tenant's pages never count
    assert index.match(prompt([9] + conversation)) == 0  # a prefix, not a substring


def test_the_sent_view_is_bounded_by_the_engines_pool() -> None:
    generations = _Generations(100)
    generations.add(list(range(1000)))
    assert len(generations) <= 100
    assert 999 in generations and 0 not in generations  # the most recent stay, the oldest go


def test_held_blocks_follow_the_engines_store_and_remove_events_in_exact_mode() -> None:
    index = CacheIndex(per_block_evictions=True, page_size=16, capacity_tokens=100_000)
    rank = index.engine_view()
    ids = list(range(200, 520))  # 320 tokens: 20 pages of 16, 10 blocks of 32
    hashes = sglang_page_hashes(ids, 16)
    rank.store(hashes, None, ids, 16)  # 0.5.23 coalesces a node's pages into one event
    index.record(prompt(ids))
    index.mode = CacheMode.EXACT
    assert index.match(prompt(ids)) == 288  # 319 cacheable tokens: 9 whole blocks
    rank.remove(hashes[12:])  # the engine evicts the tail (leaves first)
    assert index.match(prompt(ids)) == 192  # the next pick reflects it
    index.mode = CacheMode.PARTIAL  # history missing: only what the engine said it evicted is discounted
    assert index.match(prompt(ids)) == 192
    index.mode = CacheMode.APPROXIMATE  # the publisher fell silent: what kvgate sent, less what it reported evicted
    assert index.match(prompt(ids)) == 192


def test_held_blocks_place_page_by_page_events_and_an_eviction_lowers_the_least_recently_sent_copy() -> None:
    index = CacheIndex(per_block_evictions=True, page_size=1, capacity_tokens=100_000)
    rank = index.engine_view()
    ids = list(range(50, 150))
    hashes = sglang_page_hashes(ids, 1)
    for namespace in ("a", "b"):  # 0.5.8: one BlockStored per page, the same hashes in every namespace
        parent = None
        for page_hash, token in zip(hashes, ids):
            assert rank.store([page_hash], parent, [token], 1)
            parent = page_hash
        index.record(prompt(ids, namespace))
    index.mode = CacheMode.EXACT
    assert index.match(prompt(ids, "a")) == index.match(prompt(ids, "b")) == 96
    assert index.held_blocks == 3
    rank.remove(hashes)  # one copy evicted: an LRU cache evicts a's, sent first; b's prediction does not depend on a
    assert index.match(prompt(ids, "a")) == 0 and index.match(prompt(ids, "b")) == 96
    assert index.held_blocks == 3  # the other copy is still placed (a later removal of it is understood)
    index.record(prompt(ids, "a"))  # a sends it again: a's prediction comes back, its copy now the newest
    assert index.match(prompt(ids, "a")) == index.match(prompt(ids, "b")) == 96
    rank.remove(hashes)  # b's copy is now the least recently used
    assert index.held_blocks == 0 and index.match(prompt(ids, "b")) == 0 and index.match(prompt(ids, "a")) == 96
    assert not rank.store([123], 999, [1], 1)  # a parent never seen: not placed, counted
    assert rank.unplaced == 1


def test_another_namespaces_copy_stored_after_an_eviction_never_revives_a_prediction() -> None:
    """The cross-tenant oracle: A's copy of a prefix is evicted; B then sends the same prefix (its copy's
    BlockStored carries the same blind hashes). A's predicted match (on /metrics, and in its latency) must not
    tell whether B did."""
    ids = list(range(200, 520))
    hashes = sglang_page_hashes(ids, 16)
    seen = []
    for b_sends in (False, True):
        index = CacheIndex(per_block_evictions=True, page_size=16, capacity_tokens=100_000)
        rank = index.engine_view()
        index.mode = CacheMode.EXACT
        index.record(prompt(ids, "a"))
        rank.store(hashes, None, ids, 16)  # A's copy
        rank.remove(hashes)  # ... evicted
        if b_sends:
            index.record(prompt(ids, "b"))
            rank.store(hashes, None, ids, 16)  # B's copy: the same published hashes
        seen.append(index.match(prompt(ids, "a")))
    assert seen == [0, 0]


def test_a_forgotten_eviction_lowers_every_older_prediction_instead_of_reviving_it() -> None:
    index = CacheIndex(per_block_evictions=True, page_size=32, capacity_tokens=32 * 10)  # room for 10 eviction marks, in two halves
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    ids = list(range(1000, 1097))  # 3 blocks of 32
    hashes = sglang_page_hashes(ids[:96], 32)
    index.record(prompt(ids, "a"))
    rank.store(hashes, None, ids[:96], 32)
    rank.remove(hashes[2:])
    assert index.match(prompt(ids, "a")) == 64
    for page in range(20):  # others' churn pushes that mark out of the bounded view
        rank.store([10_000 + page], None, list(range(page, page + 32)), 32)
        rank.remove([10_000 + page])
    assert index.match(prompt(ids, "a")) <= 64  # never back to 96
    index.record(prompt(ids, "a"))  # a sends it again: its own prediction is back
    assert index.match(prompt(ids, "a")) == 96


# ── events on the wire ────────────────────────────────────────────────────────────────────────────────────────
def test_both_sglang_event_shapes_decode_alike() -> None:
    old = msgspec.msgpack.encode([1.5, [["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None],
                                        ["BlockRemoved", [11]], ["AllBlocksCleared"]]])
    new = msgspec.msgpack.encode([1.5, [{"type": "BlockStored", "block_hashes": [11, 12], "token_ids": [1, 2, 3, 4],
                                         "block_size": 2, "medium": "GPU"},
                                        {"type": "BlockRemoved", "block_hashes": [11]},
                                        {"type": "AllBlocksCleared"}], 0])
    expected = [Stored([11, 12], None, [1, 2, 3, 4], 2), Removed([11]), Cleared()]
    assert decode_batch(old) == expected
    assert decode_batch(new) == expected


@pytest.mark.parametrize("payload", [b"\xc1garbage", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3], 1, None]]]),
                                     msgspec.msgpack.encode([1.0, [["BlockStored", [1], "x", [1], 1, None]]]),
                                     msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [-1], 1, None]]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "Evicted"}]]),
                                     b"\x91" * 100_000 + b"\x01"])  # nested past the recursion limit
def test_malformed_batches_are_refused_whole(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


@pytest.mark.parametrize("events", [[["AllBlocksCleared"]] * (MAX_BATCH_EVENTS + 1),
                                    [["BlockRemoved", [1] * (MAX_BATCH_PAGES + 1)]],
                                    [["BlockRemoved", [1] * (MAX_BATCH_PAGES // 2 + 1)]] * 2,
                                    [["BlockRemoved", [1] * (MAX_BATCH_BYTES // 9)]],
                                    [["BlockRemoved", [2**62] * (MAX_BATCH_BYTES // 9 + 1)]]])
def test_batches_over_the_caps_are_refused(events: list[object]) -> None:
    """More events, or page hashes, than a scheduler step of a real engine publishes, or more bytes than the
    subscriber's sockets take."""
    with pytest.raises(MalformedBatch):
        decode_batch(msgspec.msgpack.encode([0.0, events]))


def test_an_engines_wildcard_bind_address_becomes_the_workers_host_with_the_ranks_port() -> None:
    assert connectable("tcp://*:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert connectable("tcp://*:5557", "10.1.2.3", rank=2) == "tcp://10.1.2.3:5559"
    assert connectable("tcp://0.0.0.0:5557", "::1") == "tcp://[::1]:5557"
    assert connectable("tcp://10.9.9.9:6000", "10.1.2.3") == "tcp://10.9.9.9:6000"


# ── the picks ─────────────────────────────────────────────────────────────────────────────────────────────────
def test_cache_aware_keeps_a_conversation_where_its_kv_is_and_records_the_pick() -> None:
    pool, policy = prefills(4), CacheAware()
    system = list(range(100, 164))
    turns = {user: system + [user] * 100 for user in range(8)}  # the shared system prompt: under half of each
    homes = {user: policy.pick(pool, RouteKey(prompt=prompt(ids))) for user, ids in turns.items()}
    assert len(set(homes.values())) == 4  # nothing held yet beyond the shared system prompt: spread out
    for user, ids in turns.items():  # the next turn of each conversation goes where the last one went
        grown = ids + [999] * 200
        key = RouteKey(prompt=prompt(grown))
        assert policy.pick(pool, key) is homes[user]
        assert key.prompt is not None and key.prompt.predicted_cached == 160


def test_cache_aware_spills_a_hot_prefix_once_queueing_costs_more_than_recomputing_it() -> None:
    pool, policy = prefills(2), CacheAware()
    shared = list(range(3000, 4000))
    first = prompt(shared + [1])
    home = policy.pick(pool, RouteKey(prompt=first))
    leases = []
    for i in range(3):  # pending prefill work piles up on the home engine
        p = prompt(shared + [2, i])
        assert policy.pick(pool, RouteKey(prompt=p)) is home
        leases.append(Lease(WorkerPair(home, prefills(1)[0]), p))
    assert home.prefill_backlog > 0
    for _ in range(20):
        leases.append(Lease(WorkerPair(home, prefills(1)[0]), prompt(list(range(10_000, 11_000)))))
    other = next(w for w in pool if w is not home)
    assert policy.pick(pool, RouteKey(prompt=prompt(shared + [3]))) is other
    for lease in leases:
        lease.release()
    assert home.prefill_backlog == 0


def test_cache_aware_is_least_loaded_by_work_when_nothing_is_shared() -> None:
    pool, policy = prefills(3), CacheAware()
    rng = random.Random(5)
    busy = Lease(WorkerPair(pool[0], prefills(1)[0]), prompt([rng.randrange(50_000) for _ in range(2000)]))
    picks = {policy.pick(pool, RouteKey(prompt=prompt([rng.randrange(50_000) for _ in range(500)])))
             for _ in range(10)}
    assert pool[0] not in picks and picks == {pool[1], pool[2]}
    busy.prefill_done()
    assert pool[0].prefill_backlog == 0


def test_kv_headroom_prefers_the_decode_where_the_request_fits_with_the_reserve() -> None:
    small = EngineIdentity(10_000, 9_000, 1, "0.5.8", "decode", "glm-5", "/t", 131072)
    big = EngineIdentity(100_000, 99_000, 1, "0.5.8", "decode", "glm-5", "/t", 131072)
    decodes = [Worker(WorkerSpec(f"http://10.0.1.{i}:30000", "decode")) for i in range(2)]
    decodes[0].accept(small)
    decodes[1].accept(big)
    policy = KvHeadroom(load_max_age_s=60)
    decodes[1].record_engine_load(EngineLoad(95_000, 95_000))  # the big one nearly full by the engine's report
    assert policy.pick(decodes, RouteKey(prompt=prompt(list(range(4000)), max_new=4000))) is decodes[0]
    decodes[1].record_engine_load(EngineLoad(91_000, 90_500))  # 9,500 free there, 10,000 on the small one
    # 9,700 prompt + output tokens: only the small one has room for them and SGLang's 512 reserved decode tokens
    assert policy.pick(decodes, RouteKey(prompt=prompt(list(range(5000)), max_new=4700))) is decodes[0]
    assert policy.free_tokens(decodes[1]) == 9_500
    decodes[1].record_engine_load(EngineLoad(80_000, 80_000))
    assert policy.pick(decodes, RouteKey(prompt=prompt(list(range(5000)), max_new=4700))) is decodes[1]
    held = Lease(WorkerPair(prefills(1)[0], decodes[0]), prompt(list(range(3000)), max_new=3000))
    assert decodes[0].reserved_tokens == 6000  # kvgate's own requests count until they end
    held.release()
    assert decodes[0].reserved_tokens == 0


def test_prefix_depth_gallops_to_the_same_answer_as_a_scan() -> None:
    rng = random.Random(9)
    for _ in range(500):
        n = rng.randrange(0, 300)
        keys = list(range(n))
        held_up_to = rng.randrange(0, n + 1)
        looked: list[int] = []

        def held(key: int) -> bool:
            looked.append(key)
            return key < held_up_to

        assert prefix_depth(keys, held) == held_up_to
        assert len(looked) <= 2 * max(1, n).bit_length() + 2  # logarithmic, not one lookup per block


def test_an_engine_reporting_more_pages_than_its_pool_holds_cannot_grow_the_view_without_bound() -> None:
    index = CacheIndex(per_block_evictions=True, page_size=32, capacity_tokens=3200)  # 100 blocks of 32: at most 200 pages held
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    sent = list(range(5000, 5097))
    index.record(prompt(sent))
    assert index.match(prompt(sent)) == 96
    for page in range(1000):
        rank.store([page], None, list(range(32)), 32)
    assert rank.overflows >= 4 and rank.blocks <= 200
    assert index.match(prompt(sent)) == 0  # its evictions could no longer be placed: it stops counting
    index.record(prompt(sent))
    assert index.match(prompt(sent)) == 96


def test_a_claimed_pool_of_10_12_tokens_is_bounded_by_the_index_bytes_shared_by_the_ranks() -> None:
    budget = 8 << 20
    index = CacheIndex(per_block_evictions=True, page_size=1, capacity_tokens=10**12, max_bytes=budget)
    views = [index.engine_view(of_ranks=2) for _ in range(2)]
    assert index.capacity_blocks * KEY_BYTES <= budget // 8  # the sent keys, copies and eviction marks: an eighth each
    tracemalloc.start()
    try:
        parent = None
        for page in range(budget // PAGE_BYTES):  # more pages than the whole budget holds, into one rank's view
            views[0].store([page], parent, [page % 50_000], 1)
            parent = page
            peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert views[0].overflows >= 1  # dropped at its share, not grown
    assert peak <= (budget - 3 * (budget // 8)) // 2 * 1.2, peak  # its share of the rest: half, with a margin


def test_a_dropped_view_lowers_even_blocks_whose_own_eviction_mark_is_older() -> None:
    index = CacheIndex(per_block_evictions=True, page_size=32, capacity_tokens=3200)  # at most 200 pages held
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    ids = list(range(5000, 5097))
    hashes = sglang_page_hashes(ids[:96], 32)
    index.record(prompt(ids))
    rank.store(hashes, None, ids[:96], 32)
    rank.remove(hashes[:1])  # the first block's eviction: marked
    index.record(prompt(ids))  # sent again since: counts again
    assert index.match(prompt(ids)) == 96
    for page in range(300):  # the view is dropped: every block sent until now stops counting
        rank.store([page], None, list(range(32)), 32)
    assert rank.overflows >= 1 and index.match(prompt(ids)) == 0
