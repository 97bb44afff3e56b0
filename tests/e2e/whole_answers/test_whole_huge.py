"""A whole answer over limits.engine_answer_bytes (a chunked body: no length to refuse it by) is a 502,
read no further, and the next request on that decode is served (held)."""

from __future__ import annotations

from pathlib import Path

import httpx

from loadtests.engine.harness import start_pair
from tests.engine_records import inject
from tests.gateway_harness import model_entry, running_gateway, write_config


def test_a_huge_whole_answer_is_a_502_and_the_next_is_served(tmp_path: Path) -> None:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5", version="0.5.23",
                    bug=False) as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode],
                                                     limits={"engine_answer_bytes": 1 << 16})])
        with running_gateway(config) as gateway:
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
            inject(pair.decode, action="huge", size=64 << 20, path="/generate", count=1)
            huge = httpx.post(gateway.url + "/generate", json=body, timeout=30)
            assert huge.status_code == 502 and huge.json()["error"]["code"] == "decode_answer_too_large", huge.text[:300]
            assert httpx.post(gateway.url + "/generate", json=body, timeout=30).status_code == 200
            assert not gateway.gateway.exchanges.running
