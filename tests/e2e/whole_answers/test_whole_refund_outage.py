"""A whole answer's output reserve is charged up front and its unused part refunded at close: the refund must land
where the charge did. Charged to the fail-open fallback during a Redis outage and refunded to Redis once it is
back, the refund is a gift: it pays off output the tenant owes the shared bucket."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from loadtests.engine.harness import start_pair
from tests.engine_records import wait_for
from tests.gateway_harness import model_entry, running_gateway, write_config
from tests.redis_harness import redis_server

pytestmark = pytest.mark.long_running(seconds=15)

KEY = b"sk-refund-outage"
PER_MIN = 1000
DEBT = -5000.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    directory = tmp_path_factory.mktemp("refund")
    tenants = [{"name": "owes", "api_keys": ["sha256:" + hashlib.sha256(KEY).hexdigest()],
                "limits": {"output_tokens_per_min": PER_MIN}}]
    with redis_server(directory) as redis, \
            start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                       bug=False, token_delay_ms=5) as pair:
        config = write_config(directory, [model_entry("glm-5", [pair.prefill], [pair.decode])], tenants=tenants,
                              state={"backend": "redis", "redis_url": redis.url, "on_redis_down": "open",
                                     "sync_interval_s": 0.1, "timeout_s": 0.3})
        with running_gateway(config) as gateway:
            yield redis, gateway


def _level(client: Any) -> float:
    return float(client.hget("kvgate:bucket:owes", "output_tokens:l"))


def test_a_reserve_charged_during_an_outage_is_not_refunded_to_redis(setup: Any) -> None:
    redis, gateway = setup
    client = redis.client()
    seconds, micros = client.time()
    client.hset("kvgate:bucket:owes", mapping={"output_tokens:l": str(DEBT),
                                               "output_tokens:t": str(seconds + micros / 1e6)})
    assert redis.process is not None
    os.kill(redis.process.pid, signal.SIGSTOP)  # an outage that keeps Redis's data
    try:
        wait_for(lambda: not gateway.gateway.fleet.state.up, timeout_s=5)
        body = b'{"model": "glm-5", "prompt": "go on", "max_tokens": 2000, "ignore_eos": true}'
        sock = socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: kvgate\r\nauthorization: Bearer %s\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (KEY, len(body), body))
        assert wait_for(lambda: gateway.gateway.exchanges.running, timeout_s=5)  # admitted on the fallback
        time.sleep(0.5)
    finally:
        os.kill(redis.process.pid, signal.SIGCONT)
    assert wait_for(lambda: gateway.gateway.fleet.state.up, timeout_s=10)
    sock.close()  # gone before its answer: nothing of its 2,000-token reserve used, all of it refunded
    assert wait_for(lambda: not gateway.gateway.exchanges.running, timeout_s=10)
    time.sleep(0.5)
    elapsed = time.time() - seconds
    refilled = DEBT + elapsed * PER_MIN / 60
    assert _level(client) <= refilled + 50, f"the tenant's debt shrank by {_level(client) - refilled:.0f} tokens"
