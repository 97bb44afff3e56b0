"""Three `kvgate serve` processes sharing one real redis-server act as one gateway: a tenant's token budget holds
across them, the kill switch reaches every replica within a second, an abort sent to one replica cancels a stream
another owns (on both halves), and a replica killed with SIGKILL leaves no phantom load once its lease lapses."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import records, wait_for
from tests.fleet.fleet_harness import ADMIN_TOKEN, chat, hashed
from tests.fleet.fleet_harness import Replica as BaseReplica
from tests.fleet.fleet_harness import replicas as replicas_of
from tests.redis_harness import RedisServer, redis_server

KEYS = {"metered": "sk-metered-0123", "capped": "sk-capped-4567", "free": "sk-free-89ab"}
TOKENS_PER_MIN = 3000
LEASE_S = 2.0


@dataclass
class Replica(BaseReplica):
    def post(self, path: str, key: str | None = "free", **kwargs: object) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEYS[key]}"} if key else {}
        return httpx.post(self.url + path, headers=headers, timeout=30, **kwargs)  # type: ignore[arg-type]

    def workers(self) -> list[dict[str, object]]:
        return httpx.get(self.url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                         timeout=10).json()["workers"]

@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                    token_delay_ms=20) as running:
        yield running


@pytest.fixture(scope="module")
def replicas(redis: RedisServer, pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    tenants = [
        {"name": "metered", "api_keys": [hashed(KEYS["metered"])], "limits": {"prompt_tokens_per_min": TOKENS_PER_MIN}},
        {"name": "capped", "api_keys": [hashed(KEYS["capped"])], "limits": {"max_concurrent": 2}},
        {"name": "free", "api_keys": [hashed(KEYS["free"])]},
    ]
    with replicas_of(tmp_path_factory.mktemp("replicas"), pair, 3, tenants=tenants, kind=Replica,
                     routing={"decode_policy": "least_outstanding"},
                     state={"redis_url": redis.url, "lease_s": LEASE_S, "sync_interval_s": 0.1,
                            "timeout_s": 1.0}) as started:  # (timeout_s: a loaded CI machine)
        yield started


def test_requests_need_a_known_api_key(replicas: list[Replica]) -> None:
    a = replicas[0]
    missing = a.post("/v1/chat/completions", key=None, json=chat("hi"))
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.post(a.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-nobody"},
                       json=chat("hi"), timeout=10)
    assert wrong.status_code == 401
    assert a.post("/v1/chat/completions", json=chat("hi")).status_code == 200


def test_a_tenants_token_budget_holds_across_replicas(replicas: list[Replica]) -> None:
    prompt = "the fleet shares one budget " * 20
    admitted, largest, refusals, served_by = 0, 0, [], set()
    started = time.monotonic()
    for i in range(80):
        replica = replicas[i % 2]
        response = replica.post("/v1/chat/completions", key="metered", json=chat(f"{i} {prompt}"))
        if response.status_code == 200:
            tokens = int(response.headers["x-kvgate-prompt-tokens"])
            admitted += tokens
            largest = max(largest, tokens)
            served_by.add(i % 2)
        else:
            assert response.status_code == 429, response.text
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(response.headers["retry-after"]) >= 1
            refusals.append(i % 2)
            if len(refusals) >= 6:
                break
    refill = TOKENS_PER_MIN / 60 * (time.monotonic() - started)
    # One budget for the fleet: at most the limit plus one request's worth (and what refilled meanwhile). Two
    # replicas counting apart would admit about twice the limit.
    assert admitted <= TOKENS_PER_MIN + largest + refill, (admitted, largest, refill)
    assert admitted >= TOKENS_PER_MIN - largest  # and the budget was really spent, not refused early
    assert served_by == {0, 1} and set(refusals) == {0, 1}


def test_the_kill_switch_reaches_every_replica_within_a_second(replicas: list[Replica]) -> None:
    a, b, c = replicas
    assert a.admin("/admin/models/glm-5/disable").status_code == 200
    switched = time.monotonic()
    for replica in (b, c):
        while (status := replica.post("/v1/chat/completions", json=chat("x")).status_code) == 200:
            assert time.monotonic() - switched < 1.0, "a replica still serves a disabled model after 1 s"
            time.sleep(0.02)
        assert status == 503
    refused = a.post("/v1/chat/completions", json=chat("x"))
    assert refused.status_code == 503 and "disabled by an operator" in refused.json()["error"]["message"]
    assert b.admin("/admin/models/glm-5/enable").status_code == 200
    switched = time.monotonic()
    for replica in replicas:
        while replica.post("/v1/chat/completions", json=chat("x")).status_code != 200:
            assert time.monotonic() - switched < 1.0
            time.sleep(0.02)


def test_an_abort_sent_to_one_replica_cancels_a_stream_another_owns_on_both_halves(
        replicas: list[Replica], pair: EnginePair) -> None:
    a, b = replicas[0], replicas[1]
    request_id = f"fleet-abort-{time.monotonic_ns()}"
    with httpx.stream("POST", b.url + "/v1/chat/completions", json=chat("tell a long story", 400, stream=True),
                      headers={"authorization": f"Bearer {KEYS['free']}", "x-request-id": request_id},
                      timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # streaming from B
        answer = a.admin(f"/admin/requests/{request_id}/abort")
        assert answer.status_code == 202, answer.text
        aborted_at = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - aborted_at < 2.0
    assert "aborted_by_operator" in rest[-1] and "[DONE]" not in "".join(rest)
    decode = [r for r in records(pair.decode) if r["request_id"] == request_id]
    prefill = [r for r in records(pair.prefill) if r["request_id"] == request_id]
    assert len(decode) == 1 and decode[0]["outcome"] in ("aborted", "client_disconnected")
    assert decode[0]["completion_tokens"] < 400
    assert len(prefill) == 1 and prefill[0]["outcome"] is not None  # prefill had answered: nothing left running
    assert a.admin("/admin/requests/no-such-request/abort").status_code == 404


def test_a_replica_killed_with_sigkill_leaves_no_phantom_load_once_its_lease_lapses(replicas: list[Replica]) -> None:
    a, c = replicas[0], replicas[2]
    streams = [httpx.stream("POST", c.url + "/v1/chat/completions", json=chat("a long one", 2000, stream=True),
                            headers={"authorization": f"Bearer {KEYS['capped']}"}, timeout=60) for _ in range(2)]
    responses = [stream.__enter__() for stream in streams]
    try:
        assert all(response.status_code == 200 for response in responses)
        # C holds both of the tenant's slots: A refuses a third, and sees C's two requests on the decode engine.
        third = a.post("/v1/chat/completions", key="capped", json=chat("one more"))
        assert third.status_code == 429 and third.headers["retry-after"]
        assert wait_for(lambda: _decode_load(a) == 2, timeout_s=2)
        c.process.send_signal(signal.SIGKILL)
        c.process.wait(timeout=10)
        killed = time.monotonic()
    finally:
        for stream in streams:
            try:
                stream.__exit__(None, None, None)
            except httpx.HTTPError:
                pass
    assert wait_for(lambda: _decode_load(a) == 0, timeout_s=LEASE_S + 2)
    assert wait_for(lambda: a.post("/v1/chat/completions", key="capped", json=chat("now")).status_code == 200,
                    timeout_s=LEASE_S + 2)
    assert time.monotonic() - killed <= LEASE_S + 2


def _decode_load(replica: Replica) -> int:
    return sum(int(w["fleet_in_flight"]) for w in replica.workers() if w["role"] == "decode")  # type: ignore[call-overload]
