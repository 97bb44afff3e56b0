"""Load-balancing policies: distribution properties, affinity that sticks and moves, breakers per leg, backpressure."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from contextlib import ExitStack

import pytest

from routing.breaker import BreakerSpec, BreakerState, CircuitBreaker
from routing.engines.identity import EngineIdentity
from routing.policies import POLICIES, RouteKey, make_policy
from routing.policies.affinity import LOAD_GUARD_ABS, PrefixAffinity, SessionAffinity
from routing.policies.hashing import ranked
from routing.policies.least_outstanding import LeastOutstanding
from routing.policies.power_of_two import PowerOfTwo
from routing.policies.random_choice import RandomChoice
from routing.policies.round_robin import RoundRobin
from routing.pools import ModelPool, NoWorkerAvailable, PoolSaturated
from routing.specs import PoolLimits
from routing.workers import Worker, WorkerSpec

IDENTITY = EngineIdentity(4096, 4090, 1, "0.5.23", "decode", "glm-5", "/t", 8192)
NO_KEY = RouteKey()


def workers(n: int, role: str = "decode", **options: object) -> list[Worker]:
    made = [Worker(WorkerSpec(f"http://10.0.0.{i}:30000", role), **options) for i in range(n)]  # type: ignore[arg-type]
    for worker in made:
        worker.accept(IDENTITY)
    return made


def test_round_robin_is_even() -> None:
    pool, policy = workers(4), RoundRobin()
    counts = Counter(policy.pick(pool, NO_KEY) for _ in range(400))
    assert set(counts.values()) == {100}


def test_random_reaches_every_worker_about_equally() -> None:
    pool, policy = workers(4), RandomChoice(random.Random(1))
    counts = Counter(policy.pick(pool, NO_KEY) for _ in range(4000))
    assert len(counts) == 4 and all(800 < c < 1200 for c in counts.values())


def test_least_outstanding_takes_the_emptiest_and_spreads_ties() -> None:
    pool, policy = workers(3), LeastOutstanding()
    with ExitStack() as busy:
        for _ in range(2):
            busy.enter_context(pool[0].load())
        busy.enter_context(pool[1].load())
        assert policy.pick(pool, NO_KEY) is pool[2]
    assert {policy.pick(pool, NO_KEY) for _ in range(6)} == set(pool)  # all idle: ties rotate


def test_power_of_two_prefers_the_engine_that_reports_less_load_and_ignores_stale_readings() -> None:
    pool = workers(2)
    policy = PowerOfTwo(max_age_s=60, rng=random.Random(3))
    pool[0].record_engine_load(50_000)
    pool[1].record_engine_load(10)
    assert {policy.pick(pool, NO_KEY) for _ in range(50)} == {pool[1]}
    stale = PowerOfTwo(max_age_s=0, rng=random.Random(3))  # every reading is too old: in-flight counts decide
    with pool[1].load():
        assert {stale.pick(pool, NO_KEY) for _ in range(50)} == {pool[0]}


def test_prefix_affinity_sticks_moves_only_the_keys_of_a_worker_that_left_and_guards_load() -> None:
    pool, policy = workers(5), PrefixAffinity()
    keys = [RouteKey(prefix=random.Random(k).getrandbits(64)) for k in range(200)]
    first = {key: policy.pick(pool, key) for key in keys}
    assert all(policy.pick(pool, key) is first[key] for key in keys)  # sticky
    assert len(set(first.values())) == 5  # and spread
    gone = pool[2]
    rest = [w for w in pool if w is not gone]
    moved = {key for key in keys if policy.pick(rest, key) is not first[key]}
    assert moved == {key for key in keys if first[key] is gone}  # only the keys the departed worker held
    hot = keys[0]
    preferred = first[hot]
    with ExitStack() as busy:
        for _ in range(LOAD_GUARD_ABS + 1):
            busy.enter_context(preferred.load())
        assert policy.pick(pool, hot) is not preferred  # overloaded: the next worker in its ranking
        assert policy.pick(pool, hot) is next(w for w in ranked(pool, hot.prefix or 0) if w is not preferred)


def test_session_affinity_keeps_a_session_on_one_worker_and_spreads_requests_without_one() -> None:
    pool, policy = workers(3), SessionAffinity()
    session = RouteKey(session=12345)
    assert len({policy.pick(pool, session) for _ in range(20)}) == 1
    assert len({policy.pick(pool, NO_KEY) for _ in range(6)}) == 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_picks_among_the_given_workers_only(name: str) -> None:
    policy = make_policy(name, load_max_age_s=5)
    pool = workers(3)
    assert policy.pick([], RouteKey(prefix=1, session=2)) is None
    assert all(policy.pick(pool[1:], RouteKey(prefix=i, session=i)) in pool[1:] for i in range(30))


def test_breaker_opens_after_failures_in_a_row_half_opens_for_one_probe_and_closes_after_successes() -> None:
    now = [0.0]
    breaker = CircuitBreaker(BreakerSpec(failure_threshold=3, success_threshold=2, open_s=10), clock=lambda: now[0])

    def request(ok: bool) -> None:
        ticket = breaker.on_dispatch()
        breaker.record(ok, ticket)
        breaker.release(ticket)

    for ok in (False, False, True, False, False):
        request(ok)
    assert breaker.state is BreakerState.CLOSED  # never 3 in a row
    request(False)
    assert breaker.state is BreakerState.OPEN and not breaker.admits()
    now[0] = 10.0
    assert breaker.state is BreakerState.HALF_OPEN and breaker.admits()
    probe = breaker.on_dispatch()
    assert probe.probe and not breaker.admits()  # one probe at a time
    breaker.record(False, probe)  # the probe failed: open again, for another open_s
    breaker.release(probe)
    assert breaker.state is BreakerState.OPEN
    now[0] = 20.0
    request(True)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.admits()
    request(True)
    assert breaker.state is BreakerState.CLOSED


def test_only_the_probe_speaks_for_a_half_open_breaker() -> None:
    now = [0.0]
    breaker = CircuitBreaker(BreakerSpec(failure_threshold=1, success_threshold=1, open_s=10), clock=lambda: now[0])
    old = [breaker.on_dispatch() for _ in range(3)]  # dispatched while closed, still running
    breaker.record(False, old[0])
    assert breaker.state is BreakerState.OPEN
    breaker.record(True, old[1])  # an older request's success says nothing about the engine now
    assert breaker.state is BreakerState.OPEN
    now[0] = 10.0
    probe = breaker.on_dispatch()
    breaker.release(old[2])  # an older request ending does not free the probe's slot
    assert not breaker.admits()
    breaker.record(True, probe)
    assert breaker.state is BreakerState.CLOSED


def test_a_worker_whose_breaker_is_open_leaves_rotation_and_says_why() -> None:
    (worker,) = workers(1, breaker=BreakerSpec(failure_threshold=2, open_s=60))
    with worker.load() as ticket:
        worker.record_outcome(False, ticket)
    assert worker.usable
    with worker.load() as ticket:
        worker.record_outcome(False, ticket)
    assert not worker.usable and worker.out_of_rotation_reason == "circuit breaker open"


def _pool(limits: PoolLimits, n: int = 1) -> ModelPool:
    return ModelPool("m", workers(n, "prefill", max_inflight=limits.max_inflight_per_worker),
                     workers(n, "decode", max_inflight=limits.max_inflight_per_worker), limits=limits)


def test_a_full_pool_queues_then_serves_in_order_and_refuses_with_retry_after_beyond_its_queue() -> None:
    async def run() -> None:
        pool = _pool(PoolLimits(max_inflight_per_worker=1, max_queue=2, queue_timeout_s=5))
        held = pool.pick_pair()  # counts one request on each worker until released
        first = held.pair
        waiting = [asyncio.ensure_future(pool.acquire_pair()) for _ in range(2)]
        await asyncio.sleep(0)
        assert pool.waiting == 2
        with pytest.raises(PoolSaturated) as refused:
            await pool.acquire_pair()  # the queue is full
        assert refused.value.retry_after_s == 5
        assert first.prefill.usable  # a full worker is not a failing one
        held.release()  # one slot frees: the first waiter gets it, the second waits on
        lease = await asyncio.wait_for(waiting[0], 1)
        await asyncio.sleep(0.05)
        assert not waiting[1].done()
        lease.release()
        (await asyncio.wait_for(waiting[1], 1)).release()

    asyncio.run(run())


def test_a_queued_request_gives_up_after_queue_timeout() -> None:
    async def run() -> None:
        pool = _pool(PoolLimits(max_inflight_per_worker=1, max_queue=4, queue_timeout_s=0.2))
        lease = pool.pick_pair()
        with pytest.raises(PoolSaturated, match="stayed at capacity"):
            await pool.acquire_pair()
        lease.release()
        assert pool.waiting == 0

    asyncio.run(run())


def test_excluded_workers_are_not_picked_again() -> None:
    pool = _pool(PoolLimits(), n=2)
    tried = {pool.decode[0]}
    for _ in range(5):
        lease = pool.pick_pair(exclude=tried)
        assert lease.pair.decode is pool.decode[1]
        lease.release()
    with pytest.raises(NoWorkerAvailable, match="tried already"):
        pool.pick_pair(exclude=set(pool.decode))


def test_a_request_arriving_while_others_wait_queues_behind_them() -> None:
    async def run() -> None:
        pool = _pool(PoolLimits(max_inflight_per_worker=1, max_queue=4, queue_timeout_s=0.5))
        held = pool.pick_pair()
        queued = asyncio.ensure_future(pool.acquire_pair())
        await asyncio.sleep(0.01)
        held.release()  # the freed slot is the queued request's
        newcomer = asyncio.ensure_future(pool.acquire_pair())
        first = await asyncio.wait_for(queued, 1)
        assert not newcomer.done()
        first.release()
        (await asyncio.wait_for(newcomer, 1)).release()

    asyncio.run(run())


def test_new_capacity_wakes_as_many_waiters_as_it_can_serve() -> None:
    async def run() -> None:
        pool = _pool(PoolLimits(max_inflight_per_worker=1, max_queue=8, queue_timeout_s=2))
        held = pool.pick_pair()
        waiting = [asyncio.ensure_future(pool.acquire_pair()) for _ in range(3)]
        await asyncio.sleep(0.01)
        pool.reconfigure(limits=PoolLimits(max_inflight_per_worker=10, max_queue=8, queue_timeout_s=2),
                         breaker=BreakerSpec(), prefill_policy=RoundRobin(), decode_policy=RoundRobin())
        leases = await asyncio.wait_for(asyncio.gather(*waiting), 1)  # all three, without any release
        for lease in [held, *leases]:
            lease.release()
        assert pool.waiting == 0 and all(w.in_flight == 0 for w in pool.workers)

    asyncio.run(run())


def test_a_woken_request_that_gives_up_passes_its_turn_on() -> None:
    async def run() -> None:
        pool = _pool(PoolLimits(max_inflight_per_worker=1, max_queue=4, queue_timeout_s=2))
        held = pool.pick_pair()
        first, second = (asyncio.ensure_future(pool.acquire_pair()) for _ in range(2))
        await asyncio.sleep(0.01)
        held.release()
        first.cancel()  # its client left just after it was woken
        (await asyncio.wait_for(second, 1)).release()

    asyncio.run(run())


def test_a_role_with_no_worker_at_all_answers_at_once_even_while_the_other_is_full() -> None:
    async def run() -> None:
        pool = _pool(PoolLimits(max_inflight_per_worker=1, max_queue=4, queue_timeout_s=5))
        held = pool.pick_pair()
        pool.decode[0].refuse("gone")
        with pytest.raises(NoWorkerAvailable, match="no usable decode worker") as caught:
            await asyncio.wait_for(pool.acquire_pair(), 1)
        gone = pool.decode[0].url
        assert gone in str(caught.value) and "gone" in str(caught.value)  # the log's version: which and why
        assert gone not in caught.value.public_message and "decode" in caught.value.public_message
        held.release()

    asyncio.run(run())
