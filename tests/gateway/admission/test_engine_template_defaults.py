"""Engines started with --default-chat-template-kwargs (SGLang 0.5.22+) fill what a request's chat_template_kwargs
leave unset. kvgate reads them from /server_info, applies them itself and forwards the result, so the engine renders
exactly the prompt that was counted; engines that disagree on them are refused (a gate failure, not a guess)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import generation_records
from tests.gateway_harness import model_entry, running_gateway, write_config

# GLM's preserved thinking: every earlier assistant turn's reasoning_content is rendered, not only the last.
DEFAULTS = {"clear_thinking": False}
REASONING = "Let me weigh every option carefully before answering. " * 200  # ~1,800 tokens, rendered only thus
CHAT = {"model": "glm-5", "max_tokens": 4, "messages": [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1", "reasoning_content": REASONING},
    {"role": "user", "content": "q2"}]}


@pytest.fixture(scope="module")
def pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=16384, model="glm-5", version="0.5.23",
                    default_chat_template_kwargs=DEFAULTS) as engines:
        yield engines


def test_the_engines_defaults_are_counted_and_forwarded(pair: EnginePair, tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode], context_length=16384)])
    with running_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=60) as client:
        answer = client.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text  # the engines' own counts agreed with kvgate's
        counted = int(answer.headers["x-kvgate-prompt-tokens"])
        assert counted > 1500  # the earlier turn's reasoning was rendered and counted
        # A request that sets the key itself keeps its own value, as SGLang's setdefault does.
        own = client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"clear_thinking": True}})
        assert own.status_code == 200 and int(own.headers["x-kvgate-prompt-tokens"]) < 100
        # A body over 64 KiB is admitted in an admission worker process: it applies them too.
        large = client.post("/v1/chat/completions", json={**CHAT, "metadata": {"pad": "x" * 70_000}})
        assert large.status_code == 200 and int(large.headers["x-kvgate-prompt-tokens"]) == counted
    assert counted in {r["prompt_tokens"] for r in generation_records(pair.prefill)}


def test_a_limit_below_the_defaults_weight_refuses_before_any_engine_sees_it(pair: EnginePair,
                                                                             tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode], context_length=16384,
                                                 max_prompt_tokens=1000)])
    seen = len(generation_records(pair.prefill))
    with running_gateway(config) as gateway:
        refused = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert refused.status_code == 413  # without the defaults it would count ~20 tokens and be sent
    assert len(generation_records(pair.prefill)) == seen


def test_workers_with_different_defaults_keep_the_deviating_one_out(tmp_path: Path, pair: EnginePair) -> None:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=16384, model="glm-5",
                    version="0.5.23") as plain:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [plain.decode],
                                                     context_length=16384)], gate={"start_anyway": True})
        seen = len(generation_records(pair.prefill))
        with running_gateway(config) as gateway:  # no majority: each differs from the other, both are refused
            ready = httpx.get(gateway.url + "/readyz", timeout=10)
            assert ready.status_code == 503 and "engine_chat_rendering" in ready.text
            refused = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30)
            assert refused.status_code == 503
        assert len(generation_records(pair.prefill)) == seen
