"""Routing over real HTTP against emulated engines: retries only where no engine got the request, breakers per leg,
health taking a dead worker out, affinity, and backpressure that ends in 503 + Retry-After, never 502."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from routing.breaker import BreakerState
from routing.policies.affinity import SessionAffinity
from tests.engine_records import generation_records, inject, reset, wait_for
from tests.gateway_harness import RunningGateway, Trio, model_entry, running_gateway, start_trio, write_config

pytestmark = pytest.mark.long_running(seconds=16)

CHAT = {"model": "glm-5", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def trio() -> Iterator[Trio]:
    with start_trio(token_delay_ms=2) as engines:
        yield engines


def gateway_for(trio: Trio, directory: Path, **model: Any) -> Any:
    """A gateway in front of the trio; the top-level health block reads every 60 s (a model may set its own)."""
    entry = model_entry("glm-5", [trio.prefill], trio.decodes, **model)
    return running_gateway(write_config(directory, [entry], health={"interval_s": 60}))


def decode_workers(gateway: RunningGateway) -> list[Any]:
    return gateway.gateway.models["glm-5"].pool.decode


def test_a_refused_connection_is_retried_on_another_pair_and_a_dead_worker_leaves_rotation(tmp_path: Path) -> None:
    engines = start_trio()
    try:
        with gateway_for(engines, tmp_path) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client, \
                gateway_for(engines, tmp_path, routing={"retries": 0}) as no_retries:
            engines.decodes[1].stop()  # the monitor reads every 60 s: only a request can find out
            statuses = [client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(4)]
            assert statuses == [200] * 4
            assert not decode_workers(gateway)[1].usable
            prefill_records = generation_records(engines.prefill)
            assert len(prefill_records) == 4  # no engine ever saw the attempt that failed to connect
            assert len({r["bootstrap_room"] for r in prefill_records}) == 4
            assert len(generation_records(engines.decodes[0])) == 4
            metrics = client.get("/metrics").text
            assert 'kvgate_retries_total{model="glm-5"} 1.0' in metrics
            without = [httpx.post(no_retries.url + "/v1/chat/completions", json=CHAT, timeout=30) for _ in range(2)]
            assert sorted(r.status_code for r in without) == [200, 502]  # retries: 0 — the refused one fails
    finally:
        engines.stop()


def test_a_killed_decode_leaves_rotation_within_the_health_thresholds_while_prefill_serves_on(tmp_path: Path) -> None:
    engines = start_trio()
    try:
        health = {"interval_s": 0.2, "timeout_s": 3, "failure_threshold": 2, "success_threshold": 1}
        with gateway_for(engines, tmp_path, health=health) as gateway, \
                httpx.Client(base_url=gateway.url, timeout=30) as client:
            dead = decode_workers(gateway)[1]
            engines.decodes[1].stop()
            assert wait_for(lambda: not dead.usable, timeout_s=3.0)  # 2 failed reads, 0.2 s apart
            assert [client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(4)] == [200] * 4
            assert len(generation_records(engines.decodes[0])) == 4
            assert client.get("/readyz").status_code == 200
    finally:
        engines.stop()


def test_a_500_after_the_engine_accepted_the_request_is_not_retried(trio: Trio, tmp_path: Path) -> None:
    reset(trio.prefill, *trio.decodes)
    with gateway_for(trio, tmp_path) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
        for decode in trio.decodes:
            inject(decode, action="fail", status=500, rid_prefix="kvg-")
        response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 502
        assert sum(len(generation_records(d)) for d in trio.decodes) == 1
        assert len(generation_records(trio.prefill)) == 1
    reset(*trio.decodes)


def test_a_flapping_decode_trips_its_own_breaker_only_and_recovers(trio: Trio, tmp_path: Path) -> None:
    reset(trio.prefill, *trio.decodes)
    breaker = {"failure_threshold": 2, "success_threshold": 1, "open_s": 1.0}
    with gateway_for(trio, tmp_path, circuit_breaker=breaker) as gateway, \
            httpx.Client(base_url=gateway.url, timeout=30) as client:
        flapping, steady = decode_workers(gateway)
        inject(trio.decodes[0], action="fail", status=500, rid_prefix="kvg-", count=2)
        statuses = [client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(4)]
        assert sorted(statuses) == [200, 200, 502, 502]  # round robin: the flapping decode failed twice
        assert flapping.breaker_state is BreakerState.OPEN and steady.breaker_state is BreakerState.CLOSED
        prefill = gateway.gateway.models["glm-5"].pool.prefill[0]
        assert prefill.breaker_state is BreakerState.CLOSED and prefill.usable  # a decode failure is the decode's
        before = len(generation_records(trio.decodes[1]))
        assert [client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(3)] == [200] * 3
        assert len(generation_records(trio.decodes[1])) == before + 3  # all on the steady decode while open
        assert wait_for(lambda: flapping.breaker_state is BreakerState.HALF_OPEN, timeout_s=2.0)
        assert [client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)] == [200] * 2
        assert flapping.breaker_state is BreakerState.CLOSED  # the probe succeeded


def test_prefix_affinity_keeps_a_shared_prefix_on_one_decode_and_cache_salt_separates(trio: Trio,
                                                                                     tmp_path: Path) -> None:
    reset(trio.prefill, *trio.decodes)
    system = {"role": "system", "content": "You are the billing assistant of Example Corp. " * 20}
    with gateway_for(trio, tmp_path, routing={"decode_policy": "prefix_affinity"}) as gateway, \
            httpx.Client(base_url=gateway.url, timeout=30) as client:
        for i in range(6):
            body = {**CHAT, "messages": [system, {"role": "user", "content": f"Question {i}?"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        counts = sorted(len(generation_records(d)) for d in trio.decodes)
        assert counts == [0, 6]
        reset(*trio.decodes)
        for salt in range(12):
            body = {**CHAT, "messages": [system, {"role": "user", "content": "Question?"}], "cache_salt": f"t{salt}"}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert all(len(generation_records(d)) > 0 for d in trio.decodes)  # other salts, other keys
        assert all("cache_salt" not in str(r) for d in trio.decodes for r in generation_records(d))


def test_session_affinity_by_header(trio: Trio, tmp_path: Path) -> None:
    reset(trio.prefill, *trio.decodes)
    routing = {"prefill_policy": "session_affinity", "decode_policy": "session_affinity",
               "affinity_header": "X-Session-Id"}
    with gateway_for(trio, tmp_path, routing=routing) as gateway, \
            httpx.Client(base_url=gateway.url, timeout=30) as client:
        for _ in range(5):
            response = client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": "alice"})
            assert response.status_code == 200
        assert sorted(len(generation_records(d)) for d in trio.decodes) == [0, 5]
        pool = gateway.gateway.models["glm-5"].pool
        assert isinstance(pool.policy("prefill"), SessionAffinity)  # one prefill here: its policy is only seen


def test_power_of_two_reads_engine_loads(trio: Trio, tmp_path: Path) -> None:
    routing = {"decode_policy": "power_of_two", "load_poll_s": 0.1}
    with gateway_for(trio, tmp_path, routing=routing) as gateway, \
            httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert wait_for(lambda: all(w.engine_load(1.0) is not None for w in decode_workers(gateway)), timeout_s=3)
        time.sleep(0.5)
        assert all(w.engine_load(0.3) is not None for w in decode_workers(gateway))  # read again since
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_prefix_tokens_sets_how_much_of_the_prompt_keys_affinity(trio: Trio, tmp_path: Path) -> None:
    reset(trio.prefill, *trio.decodes)
    routing = {"decode_policy": "prefix_affinity", "prefix_tokens": 2}  # [gMASK]<sop>: every chat alike
    with gateway_for(trio, tmp_path, routing=routing) as gateway, \
            httpx.Client(base_url=gateway.url, timeout=30) as client:
        for i in range(12):
            body = {**CHAT, "messages": [{"role": "user", "content": f"Topic {i}: {'xyz' * i}"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert sorted(len(generation_records(d)) for d in trio.decodes) == [0, 12]


def test_a_failing_health_path_takes_the_worker_out_and_a_passing_one_brings_it_back(trio: Trio,
                                                                                      tmp_path: Path) -> None:
    reset(trio.prefill, *trio.decodes)
    # The emulator answers /health after a real 1-token run of ~1 s, as SGLang does.
    health = {"path": "/health", "interval_s": 0.1, "timeout_s": 3, "failure_threshold": 1, "success_threshold": 1}
    with gateway_for(trio, tmp_path, health=health) as gateway:
        sick = decode_workers(gateway)[0]
        inject(trio.decodes[0], action="health", status=503)
        assert wait_for(lambda: not sick.usable, timeout_s=5) and sick.out_of_rotation_reason == "unhealthy"
        assert all(w.usable for w in decode_workers(gateway)[1:])
        reset(trio.decodes[0])
        assert wait_for(lambda: sick.usable, timeout_s=5)


def test_overload_ends_in_503_with_retry_after_never_502_and_workers_stay_in_rotation(trio: Trio,
                                                                                      tmp_path: Path) -> None:
    limits = {"max_inflight_per_worker": 2, "max_queue": 3, "queue_timeout_s": 10}
    with gateway_for(trio, tmp_path, limits=limits) as gateway:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                # 250 tokens at 2 ms: each holds its slots ~0.5 s
                body = {"text": "Say hello.", "sampling_params": {"max_new_tokens": 250, "ignore_eos": True},
                        "stream": True}
                return list(await asyncio.gather(*(client.post("/generate", json=body) for _ in range(24))))

        responses = asyncio.run(burst())
        statuses = [r.status_code for r in responses]
        assert set(statuses) == {200, 503}, statuses
        assert statuses.count(200) >= 5  # the one prefill's 2 slots, then the 3 that waited for them
        assert all(r.headers.get("retry-after") == "10" for r in responses if r.status_code == 503)
        assert all(r.json()["error"]["code"] == "overloaded" for r in responses if r.status_code == 503)
        assert all(r.content.endswith(b"data: [DONE]\n\n") for r in responses if r.status_code == 200)
        pool = gateway.gateway.models["glm-5"].pool
        assert wait_for(lambda: all(w.in_flight == 0 for w in pool.workers), timeout_s=5)  # every lease returned
        assert all(w.usable for w in pool.workers) and pool.waiting == 0
