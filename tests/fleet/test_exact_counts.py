"""Two `kvgate serve` replicas on one real redis-server count a tenant's requests in flight exactly: concurrent
admits on both replicas (whose writes reach Redis on pooled connections, in any order) never let a seventh stream
past `max_concurrent: 6`, and a Redis frozen for a second leaves each replica to its own share of the limit, counting
the requests it already holds."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtests.engine.harness import start_pair
from tests.fleet.fleet_harness import Replica, chat, hashed, replicas
from tests.redis_harness import RedisServer, redis_server

KEYS = {"six": "sk-six-0123", "two": "sk-two-4567"}
ROUNDS = 100


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, list[Replica]]]:
    directory = tmp_path_factory.mktemp("exact")
    tenants = [{"name": "six", "api_keys": [hashed(KEYS["six"])], "limits": {"max_concurrent": 6}},
               {"name": "two", "api_keys": [hashed(KEYS["two"])], "limits": {"max_concurrent": 2}}]
    with redis_server(directory) as redis, \
            start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                       token_delay_ms=10) as pair:
        # A short sync interval: syncs (which carry each replica's count too) land among the admits all the time.
        with replicas(directory, pair, 2, state={"redis_url": redis.url, "sync_interval_s": 0.05, "timeout_s": 0.5,
                                                 "lease_s": 5.0}, tenants=tenants) as started:
            yield redis, started


async def _open(client: httpx.AsyncClient, replica: Replica, key: str, text: str) -> httpx.Response:
    request = client.build_request("POST", replica.url + "/v1/chat/completions", json=chat(text, 2000, stream=True),
                                   headers={"authorization": f"Bearer {KEYS[key]}"})
    return await client.send(request, stream=True)


async def _quiet(client: httpx.AsyncClient, *fleet: Replica) -> None:
    """Every exchange closed on every replica (each has its tenant's pass back)."""
    deadline = time.monotonic() + 10
    while True:
        counts = [sum(int(w["in_flight"]) for w in (await client.get(
            r.url + "/admin/workers", headers={"authorization": "Bearer fleet-admin-token"})).json()["workers"]
            if w["role"] == "decode") for r in fleet]
        if not any(counts):
            return
        assert time.monotonic() < deadline, f"requests still in flight: {counts}"
        await asyncio.sleep(0.01)


def test_five_streams_on_one_replica_and_two_at_once_on_the_other_admit_exactly_one(
        fleet: tuple[RedisServer, list[Replica]]) -> None:
    _, (a, b) = fleet

    async def rounds() -> list[list[int]]:
        wrong: list[list[int]] = []
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            for i in range(ROUNDS):
                held = list(await asyncio.gather(*(_open(client, b, "six", f"{i} held {n}") for n in range(5))))
                try:
                    assert [r.status_code for r in held] == [200] * 5, [r.status_code for r in held]
                    racing = list(await asyncio.gather(*(_open(client, a, "six", f"{i} races {n}")
                                                         for n in range(2))))
                    held += racing
                    statuses = sorted(r.status_code for r in racing)
                    if statuses != [200, 429]:
                        wrong.append(statuses)
                finally:
                    await asyncio.gather(*(r.aclose() for r in held))
                await _quiet(client, a, b)
        return wrong

    started = time.monotonic()
    wrong = asyncio.run(rounds())
    assert not wrong, f"{len(wrong)} of {ROUNDS} rounds did not admit exactly one of the two: {wrong[:5]}"
    assert time.monotonic() - started < 60


def test_a_frozen_redis_leaves_each_replica_its_share_counting_what_it_already_holds(
        fleet: tuple[RedisServer, list[Replica]]) -> None:
    redis, (a, b) = fleet
    assert redis.process is not None

    async def frozen() -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=30) as client:
            first = await _open(client, a, "two", "held before the freeze")
            opened = [first]
            try:
                assert first.status_code == 200
                await asyncio.sleep(0.3)  # a's slot is in Redis, and both replicas saw each other live
                redis.process.send_signal(signal.SIGSTOP)
                try:
                    during = await asyncio.gather(*(_open(client, r, "two", f"frozen {n}")
                                                    for r in (a, b) for n in range(3)))
                    opened += during
                    await asyncio.sleep(max(0.0, 1.0 - 0.6))
                finally:
                    redis.process.send_signal(signal.SIGCONT)
                return (sum(r.status_code == 200 for r in during[:3]),
                        sum(r.status_code == 200 for r in during[3:]))
            finally:
                await asyncio.gather(*(r.aclose() for r in opened))
                await _quiet(client, a, b)

    on_a, on_b = asyncio.run(frozen())
    # max_concurrent 2 over two live replicas: one each. A already held its one, so it admits none; B one.
    assert 1 + on_a <= 1 and on_b <= 1, (on_a, on_b)
    assert on_b == 1  # B's share was usable
