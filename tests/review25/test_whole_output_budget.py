"""review25: a tenant's output budget is spent while a long request runs — for a stream (held: the suite's own
test) and, before 42cc7e7, for a client that did not stream too (decode was streamed inside kvgate). Since decode
answers a non-streaming client whole, nothing is charged until the answer is in: the tenant's next requests are
admitted all the while, however many tokens it is being given."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.engine.harness import start_pair
from tests.gateway_harness import model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=12)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                    bug=False, token_delay_ms=4) as pair:
        tenants = [{"name": name, "api_keys": ["sha256:" + hashlib.sha256(f"sk-{name}".encode()).hexdigest()],
                    "limits": {"output_tokens_per_min": 100}} for name in ("streamer", "whole")]
        config = write_config(tmp_path_factory.mktemp("t"), [model_entry("glm-5", [pair.prefill], [pair.decode])],
                              tenants=tenants)
        with running_gateway(config) as running:
            yield running


@pytest.mark.parametrize("stream", [True, False])
def test_output_tokens_are_charged_while_a_long_request_runs(gateway: Any, stream: bool) -> None:
    headers = {"authorization": "Bearer sk-" + ("streamer" if stream else "whole")}
    body = {"model": "glm-5", "prompt": "go on", "max_tokens": 1500, "ignore_eos": True, "stream": stream}
    done: list[int] = []
    long = threading.Thread(target=lambda: done.append(httpx.post(
        gateway.url + "/v1/completions", json=body, headers=headers, timeout=60).status_code))
    long.start()
    try:
        time.sleep(2.5)  # ~600 of its 1,500 tokens produced: 6x the tenant's budget a minute
        assert not done, "the long request ended too soon for this test"
        meanwhile = httpx.post(gateway.url + "/v1/completions", headers=headers, timeout=30,
                               json={"model": "glm-5", "prompt": "meanwhile", "max_tokens": 1})
    finally:
        long.join(timeout=30)
    assert done == [200]
    assert meanwhile.status_code == 429 and "output tokens" in meanwhile.json()["error"]["message"], meanwhile.text
