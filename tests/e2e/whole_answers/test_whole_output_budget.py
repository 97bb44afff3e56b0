"""A tenant's output budget is spent while a long request runs: a stream is charged as it goes; a whole answer
(decode answers a non-streaming client whole, so nothing shows its output growing) is charged its most up front,
and what it did not use is given back when it ends."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import inject
from tests.gateway_harness import model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=12)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                    bug=False, token_delay_ms=4) as pair:
        tenants = [{"name": name, "api_keys": ["sha256:" + hashlib.sha256(f"sk-{name}".encode()).hexdigest()],
                    "limits": {"output_tokens_per_min": 100}} for name in ("streamer", "whole", "refunded")]
        config = write_config(tmp_path_factory.mktemp("t"), [model_entry("glm-5", [pair.prefill], [pair.decode])],
                              tenants=tenants)
        with running_gateway(config) as running:
            running.pair = pair
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


def test_a_whole_answer_that_produced_nothing_gives_its_reserved_output_back(gateway: Any) -> None:
    pair: EnginePair = gateway.pair
    headers = {"authorization": "Bearer sk-refunded"}
    body = {"model": "glm-5", "prompt": "fails", "max_tokens": 5000}
    inject(pair.decode, action="fail", status=500, path="/v1/completions", count=1)
    failed = httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert failed.status_code == 502  # 5,000 tokens were charged up front (50x the budget a minute) ...
    time.sleep(0.5)  # (the refund is on its way to the shared state)
    again = httpx.post(gateway.url + "/v1/completions", headers=headers, timeout=30,
                       json={"model": "glm-5", "prompt": "again", "max_tokens": 1})
    assert again.status_code == 200, again.text  # ... and given back when none was produced
