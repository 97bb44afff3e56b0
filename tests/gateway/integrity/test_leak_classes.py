"""The 413 promise against the incident's engines in miniature: SGLang 0.5.8 in bug mode, KV pools of 4,096 tokens,
context 8,192, so the gateway serves at most 4,089 prompt tokens. Each class of attack that once got a prompt past
the limit through the gateway is tried again; whatever the answer, no engine may record a prompt above the limit
and no 200 may carry an earlier tenant's marker. Then the second line of defence: engines that report a prompt
count other than the gateway's get their output withheld."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import generation_records, inject, reset, wait_for
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=18)

LIMIT = 4089
MARKER = "VICTIM-MARKER-7f3a"
# A template that renders far more than the limit whatever the messages (the smuggling attack of class 1).
HUGE_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}" + " filler" * 6000


@pytest.fixture(scope="module")
def pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=4096, decode_pool=4608, context_length=8192, model="glm-5", version="0.5.8",
                    bug=True) as engines:
        yield engines


@pytest.fixture(scope="module")
def gateway(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = write_config(tmp_path_factory.mktemp("gw"), [model_entry(
        "glm-5", [pair.prefill], [pair.decode], on_pool_mismatch="clamp", default_max_tokens=4)],
        timeouts={"client_body_s": 1.0, "client_head_s": 1.0})
    with running_gateway(config) as running:
        yield running


@pytest.fixture()
def client(gateway: RunningGateway, pair: EnginePair) -> Iterator[httpx.Client]:
    reset(pair.prefill, pair.decode)
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        # An earlier tenant's request leaves its marker in the KV pool pages a leak would expose.
        victim = http.post("/v1/chat/completions", json={
            "model": "glm-5", "max_tokens": 4, "messages": [{"role": "user", "content": f"{MARKER} " * 300}]})
        assert victim.status_code == 200, victim.text
        yield http
    assert_no_engine_saw_more_than_the_limit(pair)


def assert_no_engine_saw_more_than_the_limit(pair: EnginePair) -> None:
    for engine in (pair.prefill, pair.decode):
        seen = [r["prompt_tokens"] for r in generation_records(engine) if r["prompt_tokens"] is not None]
        assert all(n <= LIMIT for n in seen), f"{engine.role} processed prompts of {max(seen)} tokens"


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "glm-5", "max_tokens": 4, "messages": messages, **extra}


def _no_marker(response: httpx.Response) -> None:
    if response.status_code == 200:
        assert MARKER not in response.text


# ── class 1: engine-side parameters smuggled through chat_template_kwargs ─────────────────────────────────────
@pytest.mark.parametrize("kwargs", [
    {"chat_template": HUGE_TEMPLATE},
    {"padding": "max_length", "max_length": 5000},
    {"padding": True, "tokenizer_kwargs": {"pad_to_multiple_of": 4096}},
    {"tokenizer_kwargs": {"split_special_tokens": True}},
    {"truncation": True, "max_length": 3},
    {"tokenize": False}, {"return_dict": True}, {"messages": []}, {"tools": []}, {"documents": [{"t": "x"}]},
    {"reasoning_effort": "high"},
])
def test_apply_chat_template_parameters_in_chat_template_kwargs_are_refused(
        client: httpx.Client, pair: EnginePair, kwargs: dict[str, Any]) -> None:
    before = len(generation_records(pair.prefill))
    response = client.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "hi"}],
                                                              chat_template_kwargs=kwargs))
    assert response.status_code == 400
    assert next(iter(kwargs)) in response.json()["error"]["message"]
    assert len(generation_records(pair.prefill)) == before


def test_template_variables_the_template_reads_are_accepted_and_counted_as_rendered(client: httpx.Client) -> None:
    for value in (True, False):
        response = client.post("/v1/chat/completions", json=_chat(
            [{"role": "user", "content": "hi"}], chat_template_kwargs={"enable_thinking": value}))
        assert response.status_code == 200, response.text
        assert int(response.headers["x-kvgate-prompt-tokens"]) == response.json()["usage"]["prompt_tokens"]


# ── class 2: fields SGLang renders differently from the raw JSON ──────────────────────────────────────────────
def _tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"t{i}"}} for i in range(n)]


@pytest.mark.parametrize(("name", "body"), [
    ("many minimal tools", _chat([{"role": "user", "content": "hi"}], tools=_tools(60))),
    ("tools ignored for tool_choice none", _chat([{"role": "user", "content": "hi"}], tools=_tools(300),
                                                  tool_choice="none")),
    ("a named tool choice", _chat([{"role": "user", "content": "hi"}], tools=_tools(300),
                                  tool_choice={"type": "function", "function": {"name": "t7"}})),
    ("trailing assistant becomes a user turn", _chat([{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "Hello there, how"}])),
    ("continue_final_message as lax text", _chat([{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "Hello there, how"}],
                                                 continue_final_message="yes")),
    ("unknown message fields and a user name", _chat([{"role": "user", "content": "hi", "name": "x" * 3000,
                                                       "thinking": "y" * 3000, "cache_control": {"a": 1}}])),
    ("string tool-call arguments", _chat([
        {"role": "user", "content": "weather?"},
        {"role": "Assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "c1"},
        {"role": "user", "content": "thanks"}])),
])
def test_the_engine_counts_what_the_gateway_counted(client: httpx.Client, name: str, body: dict[str, Any]) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert int(response.headers["x-kvgate-prompt-tokens"]) == response.json()["usage"]["prompt_tokens"], name
    _no_marker(response)


def test_many_tools_that_expand_past_the_limit_get_413_not_a_leak(client: httpx.Client, pair: EnginePair) -> None:
    before = len(generation_records(pair.prefill))
    response = client.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "hi"}], tools=_tools(400)))
    assert response.status_code == 413
    assert len(generation_records(pair.prefill)) == before


@pytest.mark.parametrize(("body", "param"), [
    (_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}]}]),
     "messages"),
    (_chat([{"role": "system", "content": "x", "tools": _tools(3)}]), "messages"),
    (_chat([{"role": "user", "content": "hi"}], input_ids=[1] * 5000), "input_ids"),
    (_chat([{"role": "user", "content": "hi"}], reasoning={"enabled": True}), "reasoning"),
    (_chat([{"role": "oracle", "content": "hi"}]), "messages"),
])
def test_what_the_gateway_cannot_count_exactly_is_refused_with_400(client: httpx.Client, body: dict[str, Any],
                                                                    param: str) -> None:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# ── class 5: malformed input is a 400 with nothing leaked ─────────────────────────────────────────────────────
def test_json_nested_past_the_serialiser_limit_is_a_400_and_leaks_no_bootstrap_room(
        client: httpx.Client, gateway: RunningGateway) -> None:
    nested = "[" * 600 + "]" * 600
    for body in (f'{{"model":"glm-5","messages":[{{"role":"user","content":"a"}}],"response_format":{nested}}}',
                 f'{{"model":"glm-5","messages":[{{"role":"user","content":"a"}}],"tools":[{{"type":"function",'
                 f'"function":{{"name":"f","parameters":{{"p":{nested}}}}}}}]}}'):
        response = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400 and "nested" in response.json()["error"]["message"]
    assert not gateway.gateway.rooms._in_use


def test_a_body_that_never_finishes_is_timed_out_with_408(gateway: RunningGateway) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n" + b"{" * 52)
        started = time.monotonic()
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and 0.5 < time.monotonic() - started < 5


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"])
def test_a_connection_that_never_finishes_its_request_head_is_closed_with_408(
        gateway: RunningGateway, sent: bytes) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        answer = sock.recv(65536)
        assert sock.recv(65536) == b""  # closed: the slot is free again
    assert answer.startswith(b"HTTP/1.1 408") and 0.5 < time.monotonic() - started < 5


def test_a_body_the_app_never_reads_still_ends_its_connection_after_the_body_timeout(gateway: RunningGateway) -> None:
    """An answer given before the body is read (here a 404) must not leave a slow body's socket open for good."""
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /nope HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10)
        started = time.monotonic()
        assert sock.recv(65536).startswith(b"HTTP/1.1 404")
        while True:  # a byte now and then, never the whole body
            try:
                sock.sendall(b"x")
            except OSError:
                break
            try:
                sock.settimeout(0.2)
                if sock.recv(65536) == b"":
                    break
            except TimeoutError:
                pass
            assert time.monotonic() - started < 8, "the connection stayed open"
    assert 1.5 < time.monotonic() - started < 8  # client_body_s (1 s) + 1


def test_two_authorization_headers_are_refused(gateway: RunningGateway) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer a\r\n"
                     b"authorization: Bearer b\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400") and b"one authorization header" in answer


def test_an_early_exit_413_states_a_bound_not_a_count(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "word " * 200_000}]))
    assert response.status_code == 413
    assert f"more than {LIMIT} tokens" in response.json()["error"]["message"]


# ── verify, then release: an engine count that differs stops the output ───────────────────────────────────────
@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_reporting_another_prompt_count_gets_502_with_zero_output_released(
        client: httpx.Client, gateway: RunningGateway, pair: EnginePair, role: str, stream: bool) -> None:
    engine = pair.prefill if role == "prefill" else pair.decode
    inject(engine, action="miscount", offset=-3, path="/v1/chat/completions", count=1)
    with client.stream("POST", "/v1/chat/completions", json=_chat(
            [{"role": "user", "content": "tell me a long story"}], max_tokens=32, stream=stream)) as response:
        body = response.read()
    assert response.status_code == 502
    error = orjson.loads(body)["error"]
    assert error["code"] == "prompt_token_mismatch" and role in error["message"]
    assert b"data:" not in body and b"story" not in body
    wait_for(lambda: not gateway.gateway.exchanges.running, timeout_s=5)
    metrics = client.get("/metrics").text
    assert f'kvgate_prompt_token_mismatches_total{{model="glm-5",role="{role}"}}' in metrics


def test_a_prefill_2xx_in_sglangs_error_shape_is_a_failure(client: httpx.Client, pair: EnginePair) -> None:
    inject(pair.prefill, action="error_body", status=200, path="/v1/chat/completions", count=1)
    response = client.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "hi"}]))
    assert response.status_code == 502 and response.json()["error"]["code"] == "prefill_failed"
