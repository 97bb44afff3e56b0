"""Redis stops mid-run: a replica set to fail open keeps serving on its share of the limits, one set to fail closed answers
503 with Retry-After; neither hangs a request; both report it in kvgate_state_backend_up and recover by themselves
when Redis is back (the kill switch works again through it)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.engine.harness import start_pair
from tests.engine_records import wait_for
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config
from tests.redis_harness import RedisServer, redis_server

KEY, OTHER_KEY = "sk-outage-tenant", "sk-outage-other"
REQUESTS_PER_MIN = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, RunningGateway, RunningGateway]]:
    directory = tmp_path_factory.mktemp("outage")
    tenants = [{"name": name, "api_keys": ["sha256:" + hashlib.sha256(key.encode()).hexdigest()],
                "limits": {"requests_per_min": REQUESTS_PER_MIN}} for name, key in (("t", KEY), ("u", OTHER_KEY))]
    previous = os.environ.get("KVGATE_ADMIN_TOKEN")
    os.environ["KVGATE_ADMIN_TOKEN"] = "outage-admin"
    try:
        yield from _running(directory, tenants)
    finally:
        if previous is None:
            os.environ.pop("KVGATE_ADMIN_TOKEN", None)
        else:
            os.environ["KVGATE_ADMIN_TOKEN"] = previous


def _running(directory: Path, tenants: list[dict[str, object]],
             ) -> Iterator[tuple[RedisServer, RunningGateway, RunningGateway]]:
    with redis_server(directory) as redis, \
            start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5",
                       version="0.5.23") as pair:
        configs = [write_config(directory, [model_entry("glm-5", [pair.prefill], [pair.decode])],
                                state={"backend": "redis", "redis_url": redis.url, "on_redis_down": mode,
                                       "sync_interval_s": 0.1, "timeout_s": 0.5}, tenants=tenants)
                   for mode in ("open", "closed")]
        with running_gateway(configs[0]) as open_, running_gateway(configs[1]) as closed:
            yield redis, open_, closed


def _ask(gateway: RunningGateway, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gateway.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 1}},
                      headers=headers, timeout=10)


def _state_up(gateway: RunningGateway) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    line = next(line for line in text.splitlines() if line.startswith("kvgate_state_backend_up "))
    return float(line.split()[1])


def test_stopping_redis_fails_open_or_closed_as_configured_and_both_recover(
        setup: tuple[RedisServer, RunningGateway, RunningGateway]) -> None:
    redis, open_, closed = setup
    assert _ask(open_).status_code == 200 and _ask(closed).status_code == 200
    # The tenant's budget is shared while Redis is up: spent through both replicas.
    statuses = [_ask(gateway, KEY).status_code for gateway in (open_, closed) * REQUESTS_PER_MIN]
    assert statuses.count(200) == REQUESTS_PER_MIN and statuses.count(429) == REQUESTS_PER_MIN
    redis.stop()
    try:
        started = time.monotonic()
        answers = [_ask(open_) for _ in range(5)]
        assert all(a.status_code == 200 for a in answers)  # open: served on this replica's own state
        assert time.monotonic() - started < 3.0  # a dead Redis never holds a request for long
        assert wait_for(lambda: _state_up(open_) == 0 and _state_up(closed) == 0, timeout_s=3)
        refused = _ask(closed)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "state_unavailable"
        # Open falls back to its share of each limit: a budget known empty stays empty, another tenant's is this
        # replica's half of it (two replicas were live: together they cannot go past the limit).
        assert _ask(open_, KEY).status_code == 429
        local = [_ask(open_, OTHER_KEY).status_code for _ in range(REQUESTS_PER_MIN + 2)]
        assert local.count(200) == REQUESTS_PER_MIN // 2 and local[-1] == 429
    finally:
        redis.start()
    assert wait_for(lambda: _state_up(open_) == 1 and _state_up(closed) == 1, timeout_s=5)
    assert wait_for(lambda: _ask(closed).status_code == 200, timeout_s=3)
    # Shared again: the kill switch set through one replica reaches the other.
    admin = {"authorization": "Bearer outage-admin"}
    assert httpx.post(closed.url + "/admin/models/glm-5/disable", headers=admin, timeout=5).status_code == 200
    assert wait_for(lambda: _ask(open_).status_code == 503, timeout_s=1)
    assert httpx.post(open_.url + "/admin/models/glm-5/enable", headers=admin, timeout=5).status_code == 200
    assert wait_for(lambda: _ask(closed).status_code == 200, timeout_s=1)
