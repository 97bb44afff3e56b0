"""What one replica writes of its own counts reaches a real redis-server on pooled connections, so in any order:
a count read earlier and arriving later never undoes a newer one. And while Redis is unreachable, a replica failing
open spends only its share of a tenant's budget, starting from its share of what Redis last said was left."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from routing.state import Budget, FleetReport
from routing.state.redis_state import RedisState, RedisTarget
from routing.state.resilient import ResilientState
from tests.redis_harness import RedisServer, redis_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as running:
        yield running


def _state(server: RedisServer) -> RedisState:
    return RedisState(RedisTarget(url=server.url, timeout_s=1.0), lease_s=5.0)


def test_a_count_read_earlier_and_arriving_later_never_undoes_a_newer_one(server: RedisServer) -> None:
    async def scenario() -> None:
        a, b = _state(server), _state(server)
        try:
            assert (await b.admit_tenant("t", [], 2, held_here=0, seq=1)).admitted
            assert (await b.admit_tenant("t", [], 2, held_here=1, seq=3)).admitted
            # Read before the second admit (one release, one sync), they reach Redis after it.
            await b.release_tenant("t", held_here=0, seq=2)
            await b.sync(FleetReport(concurrency={}, seq=2))
            assert not (await a.admit_tenant("t", [], 2, held_here=0, seq=1)).admitted  # b still holds both
            await b.release_tenant("t", held_here=1, seq=4)
            assert (await a.admit_tenant("t", [], 2, held_here=0, seq=2)).admitted
            assert not (await a.admit_tenant("t", [], 2, held_here=1, seq=3)).admitted  # 1 on a, 1 on b
            await b.release_tenant("t", held_here=0, seq=5)
            # The release (seq 5) stays as a tombstone: a sync read before it, arriving now, cannot bring b's slot back.
            await b.sync(FleetReport(concurrency={"t": 1}, seq=3))
            assert (await a.admit_tenant("t", [], 2, held_here=1, seq=4)).admitted
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_failing_open_a_replica_spends_only_its_share_of_what_was_left(server: RedisServer) -> None:
    async def scenario() -> None:
        a, b = (ResilientState(_state(server), on_down="open") for _ in range(2))
        budget = [Budget("requests", 6, 1)]
        try:
            for state in (a, b, a):  # each sees the other live
                await state.sync(FleetReport())
            assert all([(await a.admit_tenant("t", budget, None)).admitted for _ in range(2)])  # 4 left in Redis
            server.stop()
            on_a = [(await a.admit_tenant("t", budget, None)).admitted for _ in range(6)]
            on_b = [(await b.admit_tenant("t", budget, None)).admitted for _ in range(6)]
            # a: half of the 4 left; b never saw the bucket: its half of the whole budget. Not refilled meanwhile.
            assert on_a == [True] * 2 + [False] * 4, on_a
            assert on_b == [True] * 3 + [False] * 3, on_b
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())
