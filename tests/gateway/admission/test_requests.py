"""Nothing a client sends reaches an engine's internal fields; bad input is a clear 400."""

import dataclasses

import orjson
import pytest

from gateway.admission.chat import ChatSettings
from gateway.admission.dialects import Dialect
from gateway.admission.requests import ClientRequest, decode_json_object, parse_request, requested_model
from gateway.errors import GatewayError

SETTINGS = ChatSettings(content_format="openai", template_kwargs=frozenset({"enable_thinking"}))


def _parse(route: str, raw: bytes, settings: ChatSettings = SETTINGS) -> ClientRequest:
    data = decode_json_object(raw)
    requested_model(route, data)
    return parse_request(route, data, settings)

INTERNAL = {"rid": "victim-rid", "bootstrap_room": 42, "bootstrap_host": "10.0.0.9", "bootstrap_port": 1,
            "bootstrap_pair_key": "k", "data_parallel_rank": 0, "routing_key": "x", "log_metrics": False}


def test_chat_drops_engine_internal_fields() -> None:
    body = {"model": "glm-5", "messages": [{"role": "user", "content": "hi"}], **INTERNAL}
    parsed = _parse("/v1/chat/completions", orjson.dumps(body))
    assert not set(INTERNAL) & set(parsed.fields)
    assert parsed.fields["messages"] == body["messages"]


def test_generate_drops_internal_fields_at_both_levels() -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "bootstrap_room": 1}, **INTERNAL}
    parsed = _parse("/generate", orjson.dumps(body))
    assert not set(INTERNAL) & set(parsed.fields)
    assert parsed.fields["sampling_params"] == {}
    assert parsed.max_tokens == 4


@pytest.mark.parametrize(("route", "body", "fragment"), [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b'"\\ud800"', "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", b'{"model": "glm-5"}', "messages"),
    ("/v1/chat/completions", b'{"model": "glm-5", "messages": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1e30}', "max_tokens"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999}', "max_tokens"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3}', "n > 1"),
    ("/v1/completions", b'{"model": "m", "prompt": ["a", "b"]}', "batched"),
    ("/v1/completions", b'{"model": "m", "prompt": {"x": 1}}', "prompt"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "suffix": "y"}', "suffix"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "lora_path": "a"}', "lora_path"),
    ("/generate", b'{"text": ["a", "b"]}', "batched"),
    ("/generate", b'{"text": "a", "input_ids": [1]}', "exactly one"),
    ("/generate", b'{"input_embeds": [[0.1]]}', "input_embeds"),
    ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": true}}', "max_new_tokens"),
])
def test_bad_input_is_a_400_with_a_message(route: str, body: bytes, fragment: str) -> None:
    with pytest.raises(GatewayError) as caught:
        _parse(route, body)
    assert caught.value.status == 400
    assert fragment in caught.value.message


def test_tool_call_arguments_text_becomes_an_object_for_the_template() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    body = {"model": "m", "messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "content": "1", "tool_call_id": "c1"}]}
    parsed = _parse("/v1/chat/completions", orjson.dumps(body))
    plan = parsed.prompt.plan(Dialect.V0_5_22, "openai")
    assert plan.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert parsed.fields["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'


@pytest.mark.parametrize("field", ["session_params", "custom_logit_processor", "lora_path", "image_data"])
def test_fields_that_change_the_computation_are_refused_not_dropped(field: str) -> None:
    with pytest.raises(GatewayError) as caught:
        _parse("/generate", orjson.dumps({"text": "hi", field: "x"}))
    assert caught.value.status == 400 and field in caught.value.message


@pytest.mark.parametrize(("extra", "fragment"), [
    ({"reasoning_effort": []}, "reasoning_effort"),
    ({"reasoning_effort": {"x": 1}}, "reasoning_effort"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "varchar(255)"}}}}}]}, "varchar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": ["string", "string"]}}}]},
     "repeats"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": [{}]}}}]}, "standard"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": ["string", []]}}}]}, "standard"),
    ({"user": "u" * (2**20 + 1)}, "characters"),
    ({"stop": ["s" * (2**20 + 1)]}, "characters"),
])
def test_values_kvgate_cannot_forward_exactly_or_cheaply_are_400s(extra: dict[str, object], fragment: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(GatewayError) as caught:
        _parse("/v1/chat/completions", orjson.dumps(body))
    assert caught.value.status == 400 and fragment in caught.value.message


def test_a_message_name_too_large_to_forward_uncounted_is_refused() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "x", "name": "n" * (2**20 + 1)},
                                       {"role": "user", "content": "x"}]}
    with pytest.raises(GatewayError) as caught:
        _parse("/v1/chat/completions", orjson.dumps(body))
    assert caught.value.status == 400


def test_tools_with_tool_choice_none_are_not_forwarded() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f", "description": "d" * 10_000}}]}
    parsed = _parse("/v1/chat/completions", orjson.dumps(body))
    assert "tools" not in parsed.fields and "tool_choice" not in parsed.fields


@pytest.mark.parametrize("extra", [
    {"return_logprob": 1}, {"return_logprob": "true"}, {"return_logprob": [True]},
    {"return_text_in_logprobs": "yes"}, {"logprob_start_len": 1.0}, {"logprob_start_len": -2},
    {"top_logprobs_num": True}, {"top_logprobs_num": 10**6}, {"token_ids_logprob": [[1, 2]]},
    {"token_ids_logprob": ["1"]}, {"token_ids_logprob": list(range(5000))},
])
def test_generate_logprob_fields_take_exactly_their_types(extra: dict[str, object]) -> None:
    """SGLang's pydantic model would read `1` or "yes" as true where kvgate (which merges prefill's prompt logprobs
    only for a real true) would not: the answer would silently differ from what was asked."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}, **extra}
    with pytest.raises(GatewayError) as caught:
        _parse("/generate", orjson.dumps(body))
    assert caught.value.status == 400 and caught.value.param == next(iter(extra))


def test_generate_logprob_fields_of_the_right_types_are_forwarded_as_sent() -> None:
    extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5, "token_ids_logprob": [1, 2],
             "return_text_in_logprobs": False}
    parsed = _parse("/generate", orjson.dumps({"text": "hi", **extra}))
    assert {key: parsed.fields[key] for key in extra} == extra


def test_engine_default_template_kwargs_fill_only_what_the_request_left_unset() -> None:
    """As SGLang 0.5.22+: the request model sets thinking flags from reasoning_effort first, then the engine's
    defaults fill the rest (setdefault); kvgate forwards the merged kwargs, so the engine's own merge adds nothing."""
    settings = dataclasses.replace(SETTINGS, engine_defaults={"enable_thinking": False, "clear_thinking": False})
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    plain = _parse("/v1/chat/completions", orjson.dumps(chat), settings)
    assert plain.fields["chat_template_kwargs"] == {"enable_thinking": False, "clear_thinking": False}
    own = _parse("/v1/chat/completions", orjson.dumps({**chat, "chat_template_kwargs": {"enable_thinking": True}}),
                 settings)
    assert own.fields["chat_template_kwargs"] == {"enable_thinking": True, "clear_thinking": False}
    effort = _parse("/v1/chat/completions", orjson.dumps({**chat, "reasoning_effort": "high"}), settings)
    assert effort.fields["chat_template_kwargs"] == {"thinking": True, "enable_thinking": True,
                                                    "clear_thinking": False}
    assert "chat_template_kwargs" not in _parse("/v1/chat/completions", orjson.dumps(chat)).fields  # no defaults
