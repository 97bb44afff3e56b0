"""The shared-state contract, held by both backends alike (a single replica behaves the same on either): budgets
admit while they hold anything and may go into debt by one request, refusals say how long to wait, concurrency
slots are taken and given back, a dead replica's load and slots stop counting when its lease lapses, and aborts
reach the replica that owns the request. Redis is a real redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from routing.state import Budget, FleetReport, FleetState
from routing.state.memory import MemoryState
from routing.state.redis_state import RedisState, RedisTarget
from tests.redis_harness import RedisServer, redis_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


Scenario = Callable[[FleetState], Awaitable[None]]


@pytest.fixture(params=["memory", "redis"])
def on_each_backend(request: pytest.FixtureRequest, server: RedisServer) -> Callable[[Scenario], None]:
    """Runs a scenario against a fresh state of the backend (on its own event loop)."""
    def run(scenario: Scenario) -> None:
        async def main() -> None:
            if request.param == "memory":
                await scenario(MemoryState())
                return
            server.client().flushall()
            state = RedisState(RedisTarget(url=server.url, timeout_s=2.0), lease_s=1.0)
            try:
                await scenario(state)
            finally:
                await state.close()
        asyncio.run(main())
    return run


def test_requests_budget_admits_its_limit_plus_at_most_one_then_says_when_to_retry(on_each_backend: Callable[[Scenario], None]) -> None:
    async def scenario(state: FleetState) -> None:
        budget = [Budget("requests", 3, 1)]
        decisions = [await state.admit_tenant("t", budget, None) for _ in range(5)]
        assert [d.admitted for d in decisions] == [True, True, True, False, False]
        refused = decisions[3]
        assert refused.reason == "requests"
        assert 0 < refused.retry_after_s <= 20.5  # one request's worth refills in 60/3 s

    on_each_backend(scenario)


def test_a_large_request_is_admitted_into_debt_and_the_debt_is_waited_out(on_each_backend: Callable[[Scenario], None]) -> None:
    async def scenario(state: FleetState) -> None:
        budget = Budget("prompt_tokens", 600, 900)  # 10 tokens a second
        assert (await state.admit_tenant("t", [budget], None)).admitted
        refused = await state.admit_tenant("t", [Budget("prompt_tokens", 600, 1)], None)
        assert not refused.admitted and refused.reason == "prompt_tokens"
        assert 29 <= refused.retry_after_s <= 31  # 300 tokens of debt at 10 a second

    on_each_backend(scenario)


def test_a_refusal_charges_nothing(on_each_backend: Callable[[Scenario], None]) -> None:
    async def scenario(state: FleetState) -> None:
        requests, tokens = Budget("requests", 100, 1), Budget("prompt_tokens", 60, 100)
        assert (await state.admit_tenant("t", [requests, tokens], None)).admitted  # tokens now in debt
        for _ in range(5):
            assert not (await state.admit_tenant("t", [requests, tokens], None)).admitted
        # Only the first request was charged to the requests budget: 99 more fit.
        admitted = [(await state.admit_tenant("t", [requests], None)).admitted for _ in range(99)]
        assert all(admitted)

    on_each_backend(scenario)


def test_output_tokens_charged_later_block_new_requests_while_in_debt(on_each_backend: Callable[[Scenario], None]) -> None:
    async def scenario(state: FleetState) -> None:
        check = Budget("output_tokens", 60, 0)
        assert (await state.admit_tenant("t", [check], None)).admitted
        await state.charge("t", Budget("output_tokens", 60, 120))
        refused = await state.admit_tenant("t", [check], None)
        assert not refused.admitted and refused.reason == "output_tokens" and refused.retry_after_s > 59

    on_each_backend(scenario)


def test_a_charge_given_back_goes_to_the_store_that_took_it_and_never_fills_a_bucket_beyond_its_size(
        on_each_backend: Callable[[Scenario], None]) -> None:
    async def scenario(state: FleetState) -> None:
        check = Budget("output_tokens", 60, 0)
        ledger = await state.charge("t", Budget("output_tokens", 60, 120))  # 60 in debt
        assert ledger == ("shared" if state.shared else "local")
        other = "local" if ledger == "shared" else "shared"
        await state.give_back("t", Budget("output_tokens", 60, 120), other)  # not this store's: nothing back
        assert not (await state.admit_tenant("t", [check], None)).admitted
        await state.give_back("t", Budget("output_tokens", 60, 1_000_000), ledger)  # back, but only to full
        for _ in range(60):  # 60 requests of one token each fit in a full bucket of 60, and no more
            assert (await state.admit_tenant("t", [Budget("output_tokens", 60, 1)], None)).admitted
        assert not (await state.admit_tenant("t", [Budget("output_tokens", 60, 1)], None)).admitted

    on_each_backend(scenario)


def test_concurrency_slots_are_taken_and_given_back(on_each_backend: Callable[[Scenario], None]) -> None:
    async def scenario(state: FleetState) -> None:
        # The caller says how many of the tenant's requests it already holds (the limiter's own count).
        assert (await state.admit_tenant("t", [], 2, held_here=0)).admitted
        assert (await state.admit_tenant("t", [], 2, held_here=1)).admitted
        third = await state.admit_tenant("t", [], 2, held_here=2)
        assert not third.admitted and third.reason == "max_concurrent" and third.retry_after_s >= 1
        assert (await state.admit_tenant("other", [], 2, held_here=0)).admitted  # tenants are separate
        await state.release_tenant("t", held_here=1)
        assert (await state.admit_tenant("t", [], 2, held_here=1)).admitted

    on_each_backend(scenario)


def test_tenants_do_not_share_budgets(on_each_backend: Callable[[Scenario], None]) -> None:
    async def scenario(state: FleetState) -> None:
        assert (await state.admit_tenant("a", [Budget("requests", 1, 1)], None)).admitted
        assert not (await state.admit_tenant("a", [Budget("requests", 1, 1)], None)).admitted
        assert (await state.admit_tenant("b", [Budget("requests", 1, 1)], None)).admitted

    on_each_backend(scenario)


def test_kill_switch_and_aborts_come_back_in_the_view(on_each_backend: Callable[[Scenario], None]) -> None:
    async def scenario(state: FleetState) -> None:
        await state.set_disabled("m", True, cancel_inflight=True)
        await state.register_request("req-1")
        view = await state.sync(FleetReport(limits={"m": 1000}))
        assert view.disabled == {"m": True} and view.limits == {"m": 1000}
        assert await state.request_abort("req-1") == []  # its own: the asking replica aborts those itself
        assert await state.request_abort("unknown") == []
        assert (await state.sync(FleetReport())).aborts == ()
        await state.set_disabled("m", False)
        assert (await state.sync(FleetReport())).disabled == {}

    on_each_backend(scenario)


def test_two_replicas_share_load_limits_and_slots_and_a_dead_ones_lapse(server: RedisServer) -> None:
    async def scenario() -> None:
        server.client().flushall()
        a = RedisState(RedisTarget(url=server.url, timeout_s=2.0), lease_s=1.0)
        b = RedisState(RedisTarget(url=server.url, timeout_s=2.0), lease_s=1.0)
        try:
            assert (await b.admit_tenant("t", [], 2, held_here=0)).admitted
            assert (await b.admit_tenant("t", [], 2, held_here=1)).admitted
            await b.sync(FleetReport(loads={"http://w1": 5}, limits={"m": 900}, concurrency={"t": 2}))
            view = await a.sync(FleetReport(loads={"http://w1": 1}, limits={"m": 1000}))
            assert view.loads_elsewhere == {"http://w1": 5}  # b's load, not a's own
            assert view.limits == {"m": 900}  # the lowest any live replica measured
            assert not (await a.admit_tenant("t", [], 2, held_here=0)).admitted  # b holds both slots
            aborted: list[str] = []
            b.serve_aborts(lambda request_id: aborted.append(request_id) or 1)
            await b.register_request("req-b")
            await b.sync(FleetReport(concurrency={"t": 2}))
            await _listening(server, 2)
            assert await a.request_abort("req-b") == [b.replica]
            assert aborted == ["req-b"]  # answered at once, by pub/sub
            assert (await b.sync(FleetReport(concurrency={"t": 2}))).aborts == ()  # and not again at the sync
            # b dies (stops syncing): after its lease, none of its load, limits or slots count
            started = time.monotonic()
            while time.monotonic() - started < 1.5:
                await a.sync(FleetReport(loads={"http://w1": 1}, limits={"m": 1000}))
                await asyncio.sleep(0.1)
            view = await a.sync(FleetReport(loads={"http://w1": 1}, limits={"m": 1000}))
            assert view.loads_elsewhere == {} and view.limits == {"m": 1000}
            assert (await a.admit_tenant("t", [], 2, held_here=0)).admitted
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


async def _listening(server: RedisServer, replicas: int) -> None:
    """Until `replicas` replicas listen for aborts (each starts listening at its first sync)."""
    client = server.client()
    deadline = time.monotonic() + 5
    while dict(client.pubsub_numsub("kvgate:abort")).get(b"kvgate:abort", 0) < replicas:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_each_sync_makes_a_replicas_own_slot_count_the_truth(server: RedisServer) -> None:
    """A release lost to a Redis blip (or an admit whose answer was lost) cannot lock a tenant out: the replica's
    next sync replaces what Redis holds for it with what it really has in flight."""
    async def scenario() -> None:
        server.client().flushall()
        a = RedisState(RedisTarget(url=server.url, timeout_s=2.0), lease_s=5.0)
        try:
            assert (await a.admit_tenant("t", [], 1, held_here=0)).admitted  # its release never reaches Redis
            await a.sync(FleetReport(concurrency={"t": 1}))
            b = RedisState(RedisTarget(url=server.url, timeout_s=2.0), lease_s=5.0)
            assert not (await b.admit_tenant("t", [], 1, held_here=0)).admitted  # a's slot counts for b
            await a.sync(FleetReport(concurrency={}))  # nothing in flight on a any more
            assert (await b.admit_tenant("t", [], 1, held_here=0)).admitted
            await b.close()
        finally:
            await a.close()

    asyncio.run(scenario())


def test_a_replica_that_leaves_stops_counting_at_once(server: RedisServer) -> None:
    async def scenario() -> None:
        server.client().flushall()
        a = RedisState(RedisTarget(url=server.url, timeout_s=2.0), lease_s=30.0)
        b = RedisState(RedisTarget(url=server.url, timeout_s=2.0), lease_s=30.0)
        try:
            assert (await b.admit_tenant("t", [], 1, held_here=0)).admitted
            await b.sync(FleetReport(loads={"http://w1": 3}, concurrency={"t": 1}))
            assert (await a.sync(FleetReport())).loads_elsewhere == {"http://w1": 3}
            await b.leave()  # a clean stop: no waiting for the 30 s lease
            assert (await a.sync(FleetReport())).loads_elsewhere == {}
            assert (await a.admit_tenant("t", [], 1, held_here=0)).admitted
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())
