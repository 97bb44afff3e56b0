"""A replica learns the others' load on its own sync interval: a stream held through one replica shows in the
fleet-wide in-flight count another replica routes by, soon on a short interval, and on a long one only at its
syncs (two changes seen a whole interval apart)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.engine.harness import start_pair
from tests.engine_records import wait_for
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config
from tests.redis_harness import redis_server

ADMIN = {"authorization": "Bearer sync-admin"}
SLOW_SYNC_S = 1.5


@pytest.fixture
def admin_token() -> Iterator[None]:
    previous = os.environ.get("KVGATE_ADMIN_TOKEN")
    os.environ["KVGATE_ADMIN_TOKEN"] = "sync-admin"
    yield
    if previous is None:
        del os.environ["KVGATE_ADMIN_TOKEN"]
    else:
        os.environ["KVGATE_ADMIN_TOKEN"] = previous


def _decode_load(gateway: RunningGateway) -> int:
    workers = httpx.get(gateway.url + "/admin/workers", headers=ADMIN, timeout=5).json()["workers"]
    return sum(w["fleet_in_flight"] for w in workers if w["role"] == "decode")


def test_other_replicas_load_arrives_on_the_sync_interval(tmp_path: Path, admin_token: None) -> None:
    with redis_server(tmp_path) as redis, \
            start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                       token_delay_ms=20) as pair:
        def config(interval_s: float) -> Path:
            return write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode])],
                                state={"backend": "redis", "redis_url": redis.url, "sync_interval_s": interval_s,
                                       "timeout_s": 1.0})

        with running_gateway(config(0.1)) as owner, running_gateway(config(0.1)) as quick, \
                running_gateway(config(SLOW_SYNC_S)) as slow:
            time.sleep(0.3)  # past the slow replica's first sync at startup
            body = {"model": "glm-5", "messages": [{"role": "user", "content": "hold on"}], "max_tokens": 2000,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", owner.url + "/v1/chat/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                lines = response.iter_lines()  # held: a dropped iterator would close the stream
                next(lines)
                assert wait_for(lambda: _decode_load(quick) == 1, timeout_s=1.0)
                assert wait_for(lambda: _decode_load(slow) == 1, timeout_s=SLOW_SYNC_S + 1)
                seen = time.monotonic()  # just after one of the slow replica's syncs
            # The stream is gone at once; the slow replica learns it only on its next sync, an interval later.
            assert wait_for(lambda: _decode_load(quick) == 0, timeout_s=1.0)
            assert wait_for(lambda: _decode_load(slow) == 0, timeout_s=SLOW_SYNC_S + 1)
            assert time.monotonic() - seen >= SLOW_SYNC_S - 0.5
