"""An abort by request id reaches the replica that holds the request at once, by pub/sub with replies, not at that
replica's next sync: sent to the other replica 50 ms after the stream's first byte, it ends the stream. The admin
API keeps its answers: 202 with the replica that held it, 200 when only the asked replica had it, 404 when nobody."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import records, wait_for
from tests.fleet.fleet_harness import Replica, chat, hashed, replicas
from tests.redis_harness import redis_server

KEY = "sk-abort-0123"
SYNC_S = 5.0  # the registry reaches Redis only this seldom: an abort must not wait for it


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EnginePair, list[Replica]]]:
    directory = tmp_path_factory.mktemp("abort")
    with redis_server(directory) as redis, \
            start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                       token_delay_ms=20) as pair, \
            replicas(directory, pair, 2, state={"redis_url": redis.url, "sync_interval_s": SYNC_S, "lease_s": 30.0,
                                                "timeout_s": 1.0},
                     tenants=[{"name": "t", "api_keys": [hashed(KEY)]}]) as started:
        yield pair, started


def _stream(replica: Replica, request_id: str) -> httpx.Response:
    return httpx.stream("POST", replica.url + "/v1/chat/completions", json=chat("tell a long story", 400, stream=True),
                        headers={"authorization": f"Bearer {KEY}", "x-request-id": request_id}, timeout=30)


def test_an_abort_sent_to_the_other_replica_50_ms_after_the_first_byte_ends_the_stream(
        fleet: tuple[EnginePair, list[Replica]]) -> None:
    pair, (a, b) = fleet
    request_id = f"at-once-{time.monotonic_ns()}"
    with _stream(b, request_id) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        time.sleep(0.05)
        asked = time.monotonic()
        answer = a.admin(f"/admin/requests/{request_id}/abort")
        answered = time.monotonic() - asked
        rest = [line for line in lines if line.startswith("data: ")]
        ended = time.monotonic() - asked
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert body["aborted_here"] == 0 and len(body["replicas"]) == 1
    assert answered < 0.5 and ended < 1.0, (answered, ended)  # not a sync interval (5 s)
    assert "aborted_by_operator" in rest[-1] and "[DONE]" not in "".join(rest)
    assert wait_for(lambda: [r for r in records(pair.decode) if r["request_id"] == request_id
                             and r["outcome"] is not None], timeout_s=5)


def test_the_admin_answers_keep_their_meaning(fleet: tuple[EnginePair, list[Replica]]) -> None:
    _, (a, _) = fleet
    request_id = f"here-{time.monotonic_ns()}"
    with _stream(a, request_id) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        answer = a.admin(f"/admin/requests/{request_id}/abort")
        assert answer.status_code == 200 and answer.json() == {"request_id": request_id, "aborted_here": 1,
                                                                 "replicas": []}
        assert "aborted_by_operator" in [line for line in lines if line.startswith("data: ")][-1]
    asked = time.monotonic()
    assert a.admin("/admin/requests/nobody-has-this/abort").status_code == 404
    assert time.monotonic() - asked < 0.5  # every replica answered "not here": no waiting out the deadline
