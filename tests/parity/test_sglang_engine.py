"""kvgate in front of a real SGLang 0.5.8 prefill/decode pair on this machine's CPU (not the emulator): SGLang's own
launcher, scheduler, KV pools and Mooncake transfer over loopback TCP, a one-layer Llama with dummy weights and
GLM-5's tokenizer (`loadtests/sglang_reference/engine.py` says what it takes and why). Runs under `bin/test
--sglang` only; skips, saying why, where the engines cannot start here.

The engines' pools hold 4,096 tokens (`--max-total-tokens`) and advertise a 16,384-token context, the incident's
shape: the gate must refuse the model as advertised, and clamp it to what the real pools admit."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.commands.preflight import run_preflight
from gateway.config import load_config
from loadtests.sglang_reference import engine
from tests.gateway_harness import RunningGateway, model_entry, start_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=120)

# The decode's safe prompt limit: max_req_input_len 4090 (min(context - 1, pool - 1) - 5), less the 512 tokens
# SGLang 0.5.8 reserves for decoding on a decode server (num_reserved_decode_tokens).
CLAMPED = 4096 - 512


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[engine.Pair]:
    logs = tmp_path_factory.mktemp("sglang-engines")
    try:
        running = engine.start_pair(logs)
    except engine.EngineUnavailable as exc:
        pytest.skip(f"a real SGLang {engine.VERSION} engine cannot start on this machine: {exc}")
    print(f"\nSGLang {engine.VERSION} prefill and decode up in {running.startup_s:.0f} s (logs in {logs})")
    try:
        yield running
    finally:
        running.stop()


def _config(directory: Path, pair: engine.Pair, **model: object) -> Path:
    return write_config(directory, [model_entry("glm-5", [pair.prefill], [pair.decode], context_length=16384,
                                                **model)],
                        gate={"startup_timeout_s": 30.0}, health={"interval_s": 1.0, "timeout_s": 10.0})


@pytest.fixture(scope="module")
def gateway(pair: engine.Pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    running = start_gateway(_config(tmp_path_factory.mktemp("kvgate"), pair, on_pool_mismatch="clamp"),
                            timeout_s=60)
    try:
        yield running
    finally:
        running.stop()


def test_preflight_reads_the_real_pools_and_refuses_the_advertised_context(
        pair: engine.Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_preflight(load_config(_config(tmp_path, pair)), as_json=True) == 1
    model, = json.loads(capsys.readouterr().out)["models"]
    assert model["verdict"] == "refuse"
    by_role = {w["role"]: w for w in model["workers"]}
    for role in ("prefill", "decode"):
        worker = by_role[role]
        assert worker["reported_mode"] == role  # read from the engine's own --disaggregation-mode
        assert (worker["pool_tokens"], worker["max_req_input_len"], worker["context_length"], worker["version"]) == (
            engine.POOL_TOKENS, engine.POOL_TOKENS - 6, engine.CONTEXT_LENGTH, engine.VERSION)
    assert any(f"max_prompt_tokens: {CLAMPED}" in way for way in model["ways_out"])


def test_the_gate_clamps_to_what_the_real_pools_admit(gateway: RunningGateway) -> None:
    model, = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
    assert (model["max_model_len"], model["max_prompt_tokens"]) == (16384, CLAMPED)


def test_chat_and_generate_through_kvgate(gateway: RunningGateway) -> None:
    chat = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=120, json={
        "model": "glm-5", "messages": [{"role": "user", "content": "Hello from kvgate"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == int(chat.headers["x-kvgate-prompt-tokens"])  # the engine's count
    text = "The KV pool holds four thousand tokens; this prompt is far shorter."
    generate = httpx.post(f"{gateway.url}/generate", timeout=120,
                          json={"text": text, "sampling_params": {"max_new_tokens": 4}})
    assert generate.status_code == 200, generate.text
    engine_count = generate.json()["meta_info"]["prompt_tokens"]
    assert engine_count == int(generate.headers["x-kvgate-prompt-tokens"])
    tokenized = httpx.post(f"{gateway.url}/v1/tokenize", timeout=30, json={"model": "glm-5", "prompt": text})
    assert tokenized.json()["count"] == engine_count


def test_the_limit_is_served_and_one_more_token_is_413(gateway: RunningGateway) -> None:
    at_limit = httpx.post(f"{gateway.url}/generate", timeout=180,
                          json={"input_ids": [100] * CLAMPED, "sampling_params": {"max_new_tokens": 2}})
    assert at_limit.status_code == 200, at_limit.text
    assert at_limit.json()["meta_info"]["prompt_tokens"] == CLAMPED
    over = httpx.post(f"{gateway.url}/generate", timeout=60,
                      json={"input_ids": [100] * (CLAMPED + 1), "sampling_params": {"max_new_tokens": 2}})
    assert over.status_code == 413, over.text
    long_chat = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, json={
        "model": "glm-5", "messages": [{"role": "user", "content": "token " * 6000}], "max_tokens": 4})
    assert long_chat.status_code == 413, long_chat.text
    assert long_chat.json()["error"]["code"] == "context_length_exceeded"


def test_a_client_disconnect_sends_a_real_abort_request(gateway: RunningGateway, pair: engine.Pair) -> None:
    before = pair.decode.log_text().count("/abort_request")
    body = {"text": "Count to ten thousand.", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{gateway.url}/generate", json=body) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data:"):
                break  # decode's first token has arrived: the KV transfer is done
    # the connection is closed here, mid-generation
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = pair.decode.log_text()
        if log.count('"POST /abort_request HTTP/1.1" 200') > before:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"decode never received /abort_request:\n{engine._tail(pair.decode.log_text())}")
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert 'kvgate_aborts_total{acknowledged="true",role="decode"}' in metrics
