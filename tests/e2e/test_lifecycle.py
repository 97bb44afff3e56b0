"""The PD lifecycle contract against real emulated engines: disconnects hold both halves through the KV handoff,
a failure of either half cancels the other at once, and no failure becomes an HTTP 200."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import generation_records, inject, records, reset, wait_for
from tests.gateway_harness import RunningGateway, access_log_lines, model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=14)

PREFILL_TOKENS_PER_S = 2000  # a 2,000-token prompt takes ~1 s of prefill


@pytest.fixture(scope="module")
def pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=16384, model="glm-5", version="0.5.23",
                    prefill_tokens_per_s=PREFILL_TOKENS_PER_S, token_delay_ms=20,
                    disconnect_poll_s=0.5) as engines:
        yield engines


@pytest.fixture(scope="module")
def gateway(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = write_config(tmp_path_factory.mktemp("gw"), [model_entry("glm-5", [pair.prefill], [pair.decode],
                                                                      context_length=16384)],
                          timeouts={"first_token_s": 3.0, "idle_s": 2.0, "prefill_s": 5.0})
    # The emulator loads its chat template on its first chat; keep that out of the timed tests (each engine alone,
    # on SGLang's fake transfer backend: no timeout of the gateway's applies).
    for engine in (pair.prefill, pair.decode):
        warm = httpx.post(engine.url + "/v1/chat/completions", timeout=60, json={
            "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "bootstrap_host": "2.2.2.2",
            "bootstrap_room": 0})
        assert warm.status_code == 200, warm.text
    with running_gateway(config) as running:
        yield running


@pytest.fixture(autouse=True)
def clean_engines(pair: EnginePair) -> None:
    reset(pair.prefill, pair.decode)


def _send_then_disconnect(gateway: RunningGateway, body: dict, after_s: float) -> None:
    """A raw client that sends a request and closes its socket after `after_s`, whatever has arrived."""
    port = int(gateway.url.rsplit(":", 1)[1])
    payload = orjson.dumps(body)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
        time.sleep(after_s)


def _long_chat(stream: bool) -> dict:
    return {"model": "glm-5", "stream": stream, "max_tokens": 200,
            "messages": [{"role": "user", "content": "hello" + " hello" * 2000}]}


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_slow_prefill_holds_prefill_to_its_end_and_decode_past_the_kv_transfer_then_aborts(
        gateway: RunningGateway, pair: EnginePair, stream: bool) -> None:
    # The emulated prefill keeps a radix cache: the other case's identical prompt must not make this one instant.
    assert httpx.post(pair.prefill.url + "/flush_cache", timeout=10).status_code == 200
    _send_then_disconnect(gateway, _long_chat(stream), after_s=0.3)
    decode = wait_for(lambda: [r for r in generation_records(pair.decode) if r["outcome"]], timeout_s=10)
    prefill = wait_for(lambda: [r for r in generation_records(pair.prefill) if r["outcome"]], timeout_s=10)
    assert len(decode) == 1 and len(prefill) == 1
    prefill_record, decode_record = prefill[0], decode[0]
    # Prefill ran to completion although the client left at 0.3 s of a ~1 s prefill.
    assert prefill_record["outcome"] == "finished" and prefill_record["status"] == 200
    assert prefill_record["end"] - prefill_record["arrival"] > 0.7
    # Decode was held while a KV transfer could be under way, then stopped by the gateway's /abort_request (not
    # left to generate all 200 tokens): a stream to its first token; a whole answer (no first token to see) until
    # prefill had answered 2xx, which SGLang's prefill does only once its KV transfer succeeded.
    if stream:
        assert decode_record["first_token"] is not None  # decode produced its first token before being let go
        assert decode_record["connection_closed"] >= decode_record["first_token"]
    assert decode_record["connection_closed"] >= prefill_record["end"]
    # The prefill's own connection stayed open through its answer (the gateway keeps it alive for reuse).
    assert prefill_record["connection_closed"] is None or prefill_record["connection_closed"] >= prefill_record["end"]
    assert decode_record["outcome"] == "aborted"
    assert decode_record["end"] - decode_record["arrival"] < 200 * 0.02
    wait_for(lambda: not gateway.gateway.exchanges.running, timeout_s=5)
    assert not gateway.gateway.exchanges.running


def test_prefill_500_aborts_decode_within_a_second_and_client_gets_502(
        gateway: RunningGateway, pair: EnginePair) -> None:
    inject(pair.prefill, action="fail", status=500, delay_ms=200, path="/v1/chat/completions", count=1)
    started = time.monotonic()
    response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
        "model": "glm-5", "max_tokens": 50, "messages": [{"role": "user", "content": "short"}]})
    assert response.status_code == 502
    assert "prefill" in response.json()["error"]["message"]
    assert time.monotonic() - started < 1.5
    decode = wait_for(lambda: [r for r in generation_records(pair.decode) if r["outcome"]], timeout_s=3)
    assert decode and decode[0]["outcome"] in ("aborted", "client_disconnected")
    assert decode[0]["end"] - decode[0]["arrival"] < 1.0


def test_a_client_reads_which_half_failed_and_the_operator_reads_where(gateway: RunningGateway,
                                                                       pair: EnginePair) -> None:
    with access_log_lines() as lines:
        inject(pair.prefill, action="fail", status=500, path="/generate", count=1,
               message="KVPoll.Failed: bootstrap server 10.3.0.7:8998 unreachable")
        response = httpx.post(gateway.url + "/generate", timeout=30,
                              json={"text": "x", "sampling_params": {"max_new_tokens": 4}})
        wait_for(lambda: lines, timeout_s=3)
    assert response.status_code == 502 and response.json()["error"]["code"] == "prefill_failed"
    address = pair.prefill.url.split("//", 1)[1]
    assert "prefill" in response.text and address not in response.text and "10.3.0.7" not in response.text
    entry = json.loads(lines[-1])
    assert entry["status"] == 502 and address in entry["error"] and "10.3.0.7:8998" in entry["error"]


def test_prefill_400_maps_to_400(gateway: RunningGateway, pair: EnginePair) -> None:
    inject(pair.prefill, action="fail", status=400, path="/generate", count=1)
    response = httpx.post(gateway.url + "/generate", timeout=30, json={"text": "x", "sampling_params": {"max_new_tokens": 4}})
    assert response.status_code == 400


def test_decode_dropping_mid_stream_ends_the_client_stream_with_an_error_and_no_done(
        gateway: RunningGateway, pair: EnginePair) -> None:
    inject(pair.decode, action="drop", after_chunks=3, path="/v1/chat/completions", count=1)
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", timeout=30, json={
            "model": "glm-5", "stream": True, "max_tokens": 20,
            "messages": [{"role": "user", "content": "tell me a story"}]}) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] != "data: [DONE]"
    assert "error" in orjson.loads(events[-1][6:])
    assert not any(e == "data: [DONE]" for e in events)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "glm-5", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 6}}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_corrupt_decode_chunk_is_never_answered_200_even_when_it_comes_with_the_end(
        gateway: RunningGateway, pair: EnginePair, path: str, body: dict, stream: bool) -> None:
    """The corrupt event comes right before [DONE]: held events and the end are often released in one step, and the
    failure must still win over the 200 (a stream already started ends with an error event and no [DONE])."""
    for _ in range(2):
        inject(pair.decode, action="bad_chunk", path=path, count=1)
        response = httpx.post(gateway.url + path, timeout=30, json={**body, "stream": stream})
        assert b"[DONE]" not in response.content
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.status_code == 200 and b'"code":"decode_failed"' in response.content, response.text
        else:
            assert response.status_code == 502 and response.json()["error"]["code"] == "decode_failed", response.text
        # A clean answer after each: the breaker counts consecutive failures (a whole answer has no first token to
        # count as a success before its corrupt end), and this test is about the answer, not the breaker.
        assert httpx.post(gateway.url + path, timeout=30, json={**body, "stream": False}).status_code == 200


def test_decode_failure_before_first_token_keeps_its_status(gateway: RunningGateway, pair: EnginePair) -> None:
    inject(pair.decode, action="fail", status=503, path="/v1/chat/completions", count=1)
    response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
        "model": "glm-5", "stream": True, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 502
    # Prefill was cancelled at once: never sent, or ended by its abort or its closed connection.
    assert wait_for(lambda: all(r["outcome"] for r in generation_records(pair.prefill)), timeout_s=8)
    assert all(r["outcome"] in ("aborted", "client_disconnected", "error") for r in generation_records(pair.prefill))


def test_decode_that_never_answers_times_out_with_504(gateway: RunningGateway, pair: EnginePair) -> None:
    inject(pair.decode, action="hang", path="/generate", count=1)
    started = time.monotonic()
    response = httpx.post(gateway.url + "/generate", timeout=30, json={"text": "x", "sampling_params": {"max_new_tokens": 4}})
    assert response.status_code == 504
    assert 2.5 < time.monotonic() - started < 6


def test_client_rid_and_bootstrap_fields_never_reach_an_engine_and_rooms_are_unique(
        gateway: RunningGateway, pair: EnginePair) -> None:
    requests = 1000

    async def send_all() -> list[int]:
        semaphore = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            async def one(i: int) -> int:
                async with semaphore:
                    response = await client.post("/generate", json={
                        "text": f"req {i}", "rid": "victim", "bootstrap_room": 7, "bootstrap_host": "10.9.9.9",
                        "bootstrap_port": 1, "sampling_params": {"max_new_tokens": 1}})
                return response.status_code
            return list(await asyncio.gather(*(one(i) for i in range(requests))))

    assert asyncio.run(send_all()) == [200] * requests
    for engine in (pair.prefill, pair.decode):
        seen = [r for r in records(engine) if r.get("path") == "/generate"]
        assert len(seen) == requests
        assert all(r["rid"].startswith("kvg-") for r in seen)
        assert all(r["bootstrap_room"] != 7 and r["bootstrap_host"] == "127.0.0.1" for r in seen)
        # The prefill's configured bootstrap_port, never the client's.
        assert all(r["bootstrap_port"] == pair.prefill.bootstrap_port for r in seen)
        assert len({r["bootstrap_room"] for r in seen}) == requests


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "glm-5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "glm-5", "max_tokens": 8, "prompt": "hi"}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 8}}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_decode_streams_only_to_a_streaming_client_and_a_whole_answer_is_decodes_own(
        gateway: RunningGateway, pair: EnginePair, path: str, body: dict, stream: bool) -> None:
    """A client that does not stream gets decode's own whole answer (one read and one check on each side, where a
    stream costs an event per token); prefill is never streamed."""
    reset(pair.prefill, pair.decode)
    response = httpx.post(gateway.url + path, timeout=30, json={**body, "stream": stream})
    assert response.status_code == 200
    decode = wait_for(lambda: [r for r in generation_records(pair.decode) if r["outcome"]], timeout_s=5)
    prefill = wait_for(lambda: [r for r in generation_records(pair.prefill) if r["outcome"]], timeout_s=5)
    assert [r["stream"] for r in decode] == [stream] and [r["stream"] for r in prefill] == [False]
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]")
        return
    answer = response.json()
    reported = answer["meta_info"]["prompt_tokens"] if path == "/generate" else answer["usage"]["prompt_tokens"]
    assert reported == int(response.headers["x-kvgate-prompt-tokens"]) == decode[0]["prompt_tokens"]
    assert decode[0]["completion_tokens"] == 8
    if path == "/v1/chat/completions":
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
