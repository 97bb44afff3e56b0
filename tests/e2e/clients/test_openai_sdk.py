"""The official OpenAI Python SDK works unchanged against kvgate, streaming and not."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from loadtests.engine.harness import EnginePair
from tests.engine_records import generation_records, reset
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config


@pytest.fixture(scope="module")
def gateway(glm_pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = write_config(tmp_path_factory.mktemp("gw"), [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode])])
    with running_gateway(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="tenant-a-key", max_retries=0)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours 🎨"}]


def _gateway_count(client: openai.OpenAI) -> int:
    raw = client.chat.completions.with_raw_response.create(model="glm-5", messages=MESSAGES, max_tokens=1)
    return int(raw.headers["x-kvgate-prompt-tokens"])


def test_chat_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="glm-5", messages=MESSAGES, max_tokens=6)
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    assert completion.usage.prompt_tokens == _gateway_count(client)


def test_streamed_chat_completion_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="glm-5", messages=MESSAGES, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = next(c.usage for c in chunks if c.usage)
    assert usage.prompt_tokens == _gateway_count(client)


def test_completion_and_stream(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="glm-5", prompt="Once upon a time", max_tokens=5)
    assert completion.choices[0].text and completion.usage is not None
    pieces = [c.choices[0].text for c in client.completions.create(model="glm-5", prompt="Once upon a time",
                                                                    max_tokens=5, stream=True) if c.choices]
    assert "".join(pieces)


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["glm-5"]


def test_errors_surface_as_sdk_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MESSAGES)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="glm-5", messages=[{"role": "user", "content": "hi " * 9000}])
    assert caught.value.status_code == 413


def test_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve("glm-5")
    assert model.id == "glm-5" and model.owned_by == "kvgate"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in str(missing.value)


def test_every_answer_carries_a_request_id_the_clients_own_when_sane_and_engines_get_it(
        client: openai.OpenAI, glm_pair: EnginePair) -> None:
    reset(glm_pair.prefill, glm_pair.decode)
    raw = client.chat.completions.with_raw_response.create(model="glm-5", messages=MESSAGES, max_tokens=1)
    generated = raw.headers["x-request-id"]
    assert len(generated) == 32
    mine = client.chat.completions.with_raw_response.create(model="glm-5", messages=MESSAGES, max_tokens=1,
                                                            extra_headers={"x-request-id": "trace-me.42"})
    assert mine.headers["x-request-id"] == "trace-me.42"
    assert {r["request_id"] for r in generation_records(glm_pair.prefill)} == {generated, "trace-me.42"}
    assert {r["request_id"] for r in generation_records(glm_pair.decode)} == {generated, "trace-me.42"}
    odd = client.models.with_raw_response.list(extra_headers={"x-request-id": "a b;c=" + "x" * 300})
    assert odd.headers["x-request-id"] != "a b;c=" and len(odd.headers["x-request-id"]) == 32  # replaced
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="glm-5", messages=[], max_tokens=1)
    assert refused.value.response.headers["x-request-id"]


def test_both_413s_speak_openais_context_length_language(client: openai.OpenAI) -> None:
    """Clients (LiteLLM's context-window fallbacks) recognise a too-long request by OpenAI's wording: both the prompt
    over the limit and prompt + max_tokens over the context say it, with code context_length_exceeded. The SDK has
    no class of its own for 413: it raises APIStatusError with status_code 413."""
    long_prompt = [{"role": "user", "content": "word " * 9000}]
    for messages, max_tokens in ((long_prompt, 1), (MESSAGES, 8190)):
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="glm-5", messages=messages, max_tokens=max_tokens)
        error = refused.value
        assert error.status_code == 413 and error.code == "context_length_exceeded"
        assert "This model's maximum context length is" in error.message
    assert "However, you requested" in error.message and "in the completion" in error.message


def test_tokenize_counts_as_admission_does_and_detokenize_inverts_it(gateway: RunningGateway,
                                                                     client: openai.OpenAI,
                                                                     glm_pair: EnginePair) -> None:
    prompt = "Once upon a time 你好 😀 <|user|>"
    answer = httpx.post(gateway.url + "/v1/tokenize", json={"model": "glm-5", "prompt": prompt}, timeout=10).json()
    completion = client.completions.create(model="glm-5", prompt=prompt, max_tokens=1)
    assert answer["count"] == len(answer["tokens"]) == completion.usage.prompt_tokens  # the engine's own count
    assert answer["max_model_len"] == 8192 and answer["max_prompt_tokens"] > 0
    many = httpx.post(gateway.url + "/tokenize", json={"prompt": [prompt, "hi"], "add_special_tokens": False},
                      timeout=10).json()
    assert many["count"][0] == len(many["tokens"][0]) and len(many["count"]) == 2
    text = httpx.post(gateway.url + "/v1/detokenize", json={"model": "glm-5", "tokens": answer["tokens"]},
                      timeout=10).json()["text"]
    assert prompt in text
    bad = httpx.post(gateway.url + "/v1/tokenize", json={"model": "glm-5", "prompt": 5}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    unknown = httpx.post(gateway.url + "/v1/detokenize", json={"model": "nope", "tokens": [1]}, timeout=10)
    assert unknown.status_code == 404
    assert httpx.post(gateway.url + "/v1/detokenize", json={"tokens": [-1]}, timeout=10).status_code == 400
    too_many = httpx.post(gateway.url + "/v1/detokenize", json={"tokens": [1] * (2**21 + 1)}, timeout=30)
    assert too_many.status_code == 413  # counted by length before a single id is checked


def test_chat_logprobs_come_back_per_output_token(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="glm-5", messages=MESSAGES, max_tokens=4, logprobs=True,
                                                top_logprobs=2)
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in content)


def test_echo_works_and_echo_with_logprobs_is_a_clear_400(client: openai.OpenAI) -> None:
    echoed = client.completions.create(model="glm-5", prompt="Once upon a time", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("Once upon a time")
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="glm-5", prompt="Once upon a time", max_tokens=3, echo=True, logprobs=1)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "echo" and "/generate" in error["message"]


def _tool(name: str) -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_with_a_named_tool_choice_are_counted_as_sglang_counts_them(client: openai.OpenAI) -> None:
    """SGLang keeps only the named tool in the prompt: 50 tools with a named choice count as that one tool does,
    and the engine's own count agrees with the gateway's."""
    tools = [_tool(f"tool_{i}") for i in range(50)]
    choice = {"type": "function", "function": {"name": "tool_7"}}
    many = client.chat.completions.with_raw_response.create(model="glm-5", messages=MESSAGES, max_tokens=1,
                                                            tools=tools, tool_choice=choice)  # type: ignore[arg-type]
    one = client.chat.completions.with_raw_response.create(model="glm-5", messages=MESSAGES, max_tokens=1,
                                                           tools=[tools[7]], tool_choice=choice)  # type: ignore[arg-type]
    auto = client.chat.completions.with_raw_response.create(model="glm-5", messages=MESSAGES, max_tokens=1,
                                                            tools=tools)  # type: ignore[arg-type]
    counted = [int(raw.headers["x-kvgate-prompt-tokens"]) for raw in (many, one, auto)]
    assert counted[0] == counted[1] < counted[2]
    for raw, gateway_count in zip((many, one, auto), counted):
        assert raw.parse().usage.prompt_tokens == gateway_count  # the engine's count
