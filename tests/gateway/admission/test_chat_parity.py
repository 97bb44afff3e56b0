"""Parity by construction: for chat requests generated from every shape the gateway accepts, the gateway's own count
equals the count each SGLang dialect's engine reports (0.5.8, 0.5.22, 0.5.23 emulated independently). With
verify-then-release on, any disagreement would be a 502 rather than a 200."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtests.engine.harness import EnginePair, start_pair
from tests.depth import examples
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

VERSIONS = ("0.5.8", "0.5.22", "0.5.23")
CONTEXT = 65536


@pytest.fixture(scope="module")
def pairs() -> Iterator[dict[str, EnginePair]]:
    started: dict[str, EnginePair] = {}
    try:
        for version in VERSIONS:
            started[version] = start_pair(prefill_pool=CONTEXT, decode_pool=2 * CONTEXT, context_length=CONTEXT,
                                          model=f"glm-5-{version}", version=version, bug=True)
        yield started
    finally:
        for pair in started.values():
            pair.stop()


@pytest.fixture(scope="module")
def gateway(pairs: dict[str, EnginePair], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    models = [model_entry(f"glm-5-{v}", [p.prefill], [p.decode], context_length=CONTEXT, min_engine_version="0.5.8",
                          default_max_tokens=1) for v, p in pairs.items()]
    with running_gateway(write_config(tmp_path_factory.mktemp("gw"), models)) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        yield http


def _assert_parity(client: httpx.Client, body: dict[str, Any]) -> None:
    for version in VERSIONS:
        response = client.post("/v1/chat/completions", json={**body, "model": f"glm-5-{version}", "max_tokens": 1})
        assert response.status_code == 200, (version, response.text)
        gateway_count = int(response.headers["x-kvgate-prompt-tokens"])
        assert gateway_count == response.json()["usage"]["prompt_tokens"], version


# ── strategies: every shape the gateway accepts ───────────────────────────────────────────────────────────────
_text = st.lists(st.sampled_from([*string.ascii_letters, *" \n\t.,{}\"'", "你", "好", "😀", "é", "<|user|>",
                                  "<think>", "</think>", "[gMASK]", "<|", "\\", " hello", "  "]),
                 max_size=30).map("".join)
_name = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)
_json_value = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | _text,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_name, inner, max_size=3),
                           max_leaves=6)
_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=3)
_content = _text | _parts
_extra_fields = st.dictionaries(st.sampled_from(["thinking", "refusal", "cache_control", "audio", "weight"]),
                                _json_value, max_size=2)


@st.composite
def _tool_call(draw: st.DrawFn, index: int) -> dict[str, Any]:
    arguments = draw(st.dictionaries(_name, _json_value, max_size=3))
    function: dict[str, Any] = {"name": draw(_name)}
    function["arguments"] = arguments if draw(st.booleans()) else json.dumps(arguments)
    call: dict[str, Any] = {"type": "function", "function": function}
    if draw(st.booleans()):
        call["id"] = f"call_{index}"
    if draw(st.booleans()):
        call["index"] = index
    return call


@st.composite
def _message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "system", "System", "developer", "assistant", "ASSISTANT", "tool"]))
    message: dict[str, Any] = {"role": role, **draw(_extra_fields)}
    if role == "user":
        message["content"] = draw(_content)
        if draw(st.booleans()):
            message["name"] = draw(_name)
        return message
    message["content"] = draw(st.none() | _content)
    if draw(st.booleans()):
        message["name"] = draw(_name)
    if role.lower() == "assistant":
        if draw(st.booleans()):
            message["reasoning_content"] = draw(_text)
        if draw(st.booleans()):
            message["tool_calls"] = [draw(_tool_call(i)) for i in range(draw(st.integers(1, 2)))]
    if role == "tool":
        message["tool_call_id"] = "call_0"
    return message


@st.composite
def _tool(draw: st.DrawFn) -> dict[str, Any]:
    fields: dict[str, Any] = {"name": draw(_name)}
    if draw(st.booleans()):
        fields["description"] = draw(_text)
    if draw(st.booleans()):
        properties = draw(st.dictionaries(_name, st.sampled_from([{"type": "string"}, {"type": "integer"},
                                                                  {"type": "array", "items": {"type": "number"}}]),
                                          max_size=3))
        fields["parameters"] = {"type": "object", "properties": properties}
    if draw(st.booleans()):
        fields["strict"] = draw(st.sampled_from([True, False, "true", "no", 1]))
    order = draw(st.permutations(list(fields)))
    tool: dict[str, Any] = {"type": "function", "function": {key: fields[key] for key in order}}
    if draw(st.booleans()):
        tool["function"]["unknown_key"] = "dropped"
    return tool


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    messages = draw(st.lists(_message(), min_size=1, max_size=5))
    if not any(m["role"] == "user" for m in messages):
        messages.insert(0, {"role": "user", "content": draw(_text)})
    body: dict[str, Any] = {"messages": messages}
    tools = draw(st.lists(_tool(), max_size=4, unique_by=lambda t: t["function"]["name"]))
    if tools:
        body["tools"] = tools
        choice = draw(st.sampled_from(["absent", "none", "auto", "required", "named"]))
        if choice == "named":
            body["tool_choice"] = {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
        elif choice != "absent":
            body["tool_choice"] = choice
    kwargs = draw(st.dictionaries(st.sampled_from(["enable_thinking", "clear_thinking"]), st.booleans(), max_size=2))
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    effort = draw(st.sampled_from([None, "low", "medium", "high"]))
    if effort:
        body["reasoning_effort"] = effort
    final = draw(st.sampled_from([None, True, False, "yes", "off", 1, 0]))
    if final is not None:
        body["continue_final_message"] = final
    return body


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=chat_bodies())
def test_gateway_count_equals_every_dialects_engine_count(client: httpx.Client, body: dict[str, Any]) -> None:
    _assert_parity(client, body)


@pytest.mark.parametrize("tools", [500])
def test_hundreds_of_minimal_tools_are_counted_as_each_version_expands_them(client: httpx.Client, tools: int) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": f"tool_{i}"}} for i in range(tools)]}
    _assert_parity(client, body)
    counts = {v: int(client.post("/v1/chat/completions", json={**body, "model": f"glm-5-{v}", "max_tokens": 1})
                     .headers["x-kvgate-prompt-tokens"]) for v in VERSIONS}
    assert len(set(counts.values())) == 3  # each version renders the tools differently; each count matched
