"""LiteLLM as a client library, unchanged: completion and acompletion, streamed and not, against kvgate over real
HTTP; both of kvgate's "too long" answers (prompt over the limit, prompt + max_tokens over the context) raise
LiteLLM's ContextWindowExceededError, which its users' context_window_fallbacks rely on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from types import ModuleType

import pytest

from loadtests.engine.harness import EnginePair
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def litellm() -> ModuleType:
    """Imported by the tests that use it (~5 s), not by every test worker while it collects the suite."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map from the internet
    import litellm

    return litellm


@pytest.fixture(scope="module")
def gateway(glm_pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = write_config(tmp_path_factory.mktemp("gw"), [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode],
                                                                      max_prompt_tokens=2000)])
    with running_gateway(config) as running:
        yield running


def _options(gateway: RunningGateway) -> dict[str, object]:
    return {"model": "openai/glm-5", "api_base": gateway.url + "/v1", "api_key": "tenant-key", "num_retries": 0}


def test_completion_and_stream(litellm: ModuleType, gateway: RunningGateway) -> None:
    response = litellm.completion(messages=MESSAGES, max_tokens=5, **_options(gateway))
    assert response.choices[0].message.content and response.usage.completion_tokens == 5
    chunks = list(litellm.completion(messages=MESSAGES, max_tokens=5, stream=True, **_options(gateway)))
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_acompletion_and_stream(litellm: ModuleType, gateway: RunningGateway) -> None:
    async def run() -> tuple[str, str]:
        response = await litellm.acompletion(messages=MESSAGES, max_tokens=4, **_options(gateway))
        stream = await litellm.acompletion(messages=MESSAGES, max_tokens=4, stream=True, **_options(gateway))
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        return response.choices[0].message.content, text

    whole, streamed = asyncio.run(run())
    assert whole and streamed


@pytest.mark.parametrize(("messages", "max_tokens"), [
    ([{"role": "user", "content": "word " * 3000}], 1),  # the prompt alone is over the limit
    (MESSAGES, 8190),  # prompt + requested completion over the context
])
def test_both_too_long_answers_are_context_window_errors(litellm: ModuleType, gateway: RunningGateway,
                                                         messages: list[dict[str, str]], max_tokens: int) -> None:
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=messages, max_tokens=max_tokens, **_options(gateway))
