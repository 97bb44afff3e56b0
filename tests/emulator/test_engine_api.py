"""Endpoint shapes, PD handshake, timeouts, disconnects, abort_request and fault injection of the engine emulator."""

from __future__ import annotations

import asyncio
import gzip
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from loadtests.engine.harness import EnginePair, free_port, start_pair
from tests.engine_records import pd_request, records

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "config" / "models" / "glm-5"
OPTS = {"health_delay_s": 0, "bootstrap_timeout_s": 1.0, "waiting_timeout_s": 1.0, "disconnect_poll_s": 0.2,
        "stream_abort_delay_s": 0.2}


@pytest.fixture(scope="module")
def pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=8192, decode_pool=8192, context_length=4096, **OPTS) as p:
        yield p


@pytest.fixture(autouse=True)
def _reset(pair: EnginePair) -> None:
    for url in (pair.prefill.url, pair.decode.url):
        call("POST", url + "/emu/reset")


def call(method: str, url: str, body: Any = None, timeout: float = 10) -> tuple[int, bytes, dict[str, str]]:
    async def go() -> tuple[int, bytes, dict[str, str]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async with s.request(method, url, json=body) as r:
                return r.status, await r.read(), dict(r.headers)

    return asyncio.run(go())


def jcall(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    status, data, _ = call(method, url, body)
    return status, orjson.loads(data) if data else None


def sse_events(body: bytes) -> list[Any]:
    assert body.endswith(b"data: [DONE]\n\n")
    parts = [p for p in body.split(b"\n\n") if p]
    assert all(p.startswith(b"data: ") for p in parts)
    return [orjson.loads(p[6:]) for p in parts[:-1]]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("glm5")
    (d / "tokenizer.json").write_bytes(gzip.decompress((TOKENIZER_DIR / "tokenizer.json.gz").read_bytes()))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (d / name).write_bytes((TOKENIZER_DIR / name).read_bytes())
    return AutoTokenizer.from_pretrained(str(d))


# info endpoints

def test_server_info_fields(pair: EnginePair) -> None:
    for eng, role in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        for path in ("/server_info", "/get_server_info"):
            status, info = jcall("GET", eng.url + path)
            assert status == 200
            assert info["max_total_num_tokens"] == 8192
            assert info["max_req_input_len"] == min(4096 - 1, 8192 - 1) - 5
            assert info["context_length"] == 4096
            assert info["disaggregation_mode"] == role
            assert info["disaggregation_bootstrap_port"] == pair.prefill.bootstrap_port
            assert info["page_size"] == 1 and info["version"] == "0.5.8" and info["status"] == "ready"
            assert info["tokenizer_path"] and info["served_model_name"] == "glm-5-emu"
            assert info["internal_states"][0]["memory_usage"]["token_capacity"] == 8192
            assert {"tp_size", "dp_size", "model_path"} <= set(info)


def test_model_info_models_and_loads(pair: EnginePair) -> None:
    url = pair.decode.url
    for path in ("/model_info", "/get_model_info"):
        status, mi = jcall("GET", url + path)
        assert status == 200 and {"model_path", "tokenizer_path", "is_generation", "weight_version"} <= set(mi)
    status, models = jcall("GET", url + "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert models["data"][0]["id"] == "glm-5-emu" and models["data"][0]["max_model_len"] == 4096
    status, load = jcall("GET", url + "/get_load")
    assert status == 200 and isinstance(load, list)
    assert set(load[0]) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}
    status, loads = jcall("GET", url + "/v1/loads")
    assert status == 200 and set(loads) >= {"timestamp", "version", "dp_rank_count", "loads", "aggregate"}
    l0 = loads["loads"][0]
    assert l0["max_total_num_tokens"] == 8192 and l0["disaggregation"]["mode"] == "decode"
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage"} <= set(l0)


def test_health_metrics_flush(pair: EnginePair) -> None:
    url = pair.prefill.url
    assert call("GET", url + "/health")[0] == 200
    assert call("GET", url + "/health_generate")[0] == 200
    status, text, _ = call("GET", url + "/metrics")
    assert status == 200
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens", "sglang:token_usage",
                 "sglang:max_total_num_tokens", "sglang:num_prefill_prealloc_queue_reqs",
                 "sglang:num_decode_transfer_queue_reqs", "sglang:num_bootstrap_failed_reqs_total",
                 "sglang:num_transfer_failed_reqs_total", "sglang:time_to_first_token_seconds_bucket",
                 "sglang:e2e_request_latency_seconds_bucket", "sglang:num_requests_total"):
        assert name.encode() in text, name
    assert b'engine_type="prefill"' in text and b'model_name="glm-5-emu"' in text
    status, text, _ = call("POST", url + "/flush_cache")
    assert status == 200 and text.startswith(b"Cache flushed.")


# generation shapes

def test_generate_shape_and_counting(pair: EnginePair, hf_tokenizer: Any) -> None:
    text = "Hello there, how are you today?"
    (ps, pb), (ds, db) = pd_request(pair, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 5}}, room=1)
    assert ps == ds == 200
    p, d = orjson.loads(pb), orjson.loads(db)
    assert len(p["output_ids"]) == 1 and p["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert set(d) == {"text", "output_ids", "meta_info"} and len(d["output_ids"]) == 5
    meta = d["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"} <= set(meta)
    assert meta["prompt_tokens"] == len(hf_tokenizer(text)["input_ids"])
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 5


def test_generate_stream_is_cumulative(pair: EnginePair) -> None:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}, "stream": True}
    (ps, _), (ds, db) = pd_request(pair, "/generate", body, room=2)
    assert ps == ds == 200
    events = sse_events(db)
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4]
    assert all(events[i + 1]["text"].startswith(events[i]["text"]) for i in range(3))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[0]["meta_info"]["finish_reason"] is None


def test_chat_shapes_and_usage(pair: EnginePair, hf_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    expected = len(hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    (ps, _), (ds, db) = pd_request(pair, "/v1/chat/completions", {"model": "glm-5-emu", "messages": messages,
                                                          "max_tokens": 6}, room=3)
    assert ps == ds == 200
    d = orjson.loads(db)
    assert {"id", "object", "created", "model", "choices", "usage"} <= set(d) and d["object"] == "chat.completion"
    ch = d["choices"][0]
    assert {"index", "message", "logprobs", "finish_reason", "matched_stop"} <= set(ch)
    assert set(ch["message"]) >= {"role", "content", "reasoning_content", "tool_calls"}
    assert ch["finish_reason"] == "length"
    assert d["usage"]["prompt_tokens"] == expected
    assert d["usage"]["completion_tokens"] == 6 and d["usage"]["total_tokens"] == expected + 6


def test_chat_stream_deltas_and_usage_chunk(pair: EnginePair) -> None:
    body = {"messages": [{"role": "user", "content": "count to three"}], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    (ps, _), (ds, db) = pd_request(pair, "/v1/chat/completions", body, room=4)
    assert ps == ds == 200
    events = sse_events(db)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "reasoning_content": None,
                                                "tool_calls": None}
    content = [e for e in events[1:] if e["choices"] and e["choices"][0]["delta"]["content"] is not None]
    assert len(content) == 8
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def test_completions_shapes(pair: EnginePair, hf_tokenizer: Any) -> None:
    (ps, _), (ds, db) = pd_request(pair, "/v1/completions", {"prompt": "Once upon a time"}, room=5)
    assert ps == ds == 200
    d = orjson.loads(db)
    assert d["object"] == "text_completion" and set(d["choices"][0]) >= {"index", "text", "logprobs",
                                                                         "finish_reason"}
    assert d["usage"]["completion_tokens"] == 16  # CompletionRequest.max_tokens default
    assert d["usage"]["prompt_tokens"] == len(hf_tokenizer("Once upon a time")["input_ids"])
    (ps, _), (ds, db) = pd_request(pair, "/v1/completions", {"prompt": "Once", "max_tokens": 3, "stream": True}, room=6)
    events = sse_events(db)
    assert len(events) == 3 and events[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_requires_json_content_type(pair: EnginePair) -> None:
    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s:
            async with s.post(pair.decode.url + "/v1/chat/completions", data=b"{}",
                              headers={"content-type": "text/plain"}) as r:
                return r.status, await r.json(content_type=None)

    status, body = asyncio.run(go())
    assert status == 400 and body["object"] == "error" and body["code"] == 400


# PD handshake and timeouts

def test_missing_bootstrap_room_is_400(pair: EnginePair) -> None:
    for eng in (pair.prefill, pair.decode):
        status, body = jcall("POST", eng.url + "/generate", {"text": "hi", "rid": "noroom"})
        assert status == 400
        assert body["error"]["message"].startswith("Invalid request: Disaggregated request received without "
                                                   "boostrap room id")


def test_fake_bootstrap_host_skips_transfer(pair: EnginePair) -> None:
    body = {"text": "hi", "bootstrap_host": "2.2.2.2", "bootstrap_room": 0, "sampling_params": {"max_new_tokens": 2}}
    for eng in (pair.prefill, pair.decode):
        status, out = jcall("POST", eng.url + "/generate", body)
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_prefill_alone_times_out_waiting_for_decode(pair: EnginePair) -> None:
    t0 = time.monotonic()
    status, body = jcall("POST", pair.prefill.url + "/generate",
                         {"text": "hi", "rid": "lonely-p", **pair.bootstrap_fields(77)})
    assert 0.9 < time.monotonic() - t0 < 3
    assert status == 500 and body["message"].startswith("Prefill bootstrap failed for request")
    assert body["object"] == "error" and body["code"] == 500


def test_decode_alone_times_out_waiting_for_transfer(pair: EnginePair) -> None:
    status, body = jcall("POST", pair.decode.url + "/generate",
                         {"text": "hi", "rid": "lonely-d", **pair.bootstrap_fields(78)})
    assert status == 500 and "KVPoll.WaitingForInput" in body["message"]
    rec = records(pair.decode.url, "lonely-d")[0]
    assert rec["outcome"] == "error" and rec["status"] == 500


def test_unreachable_bootstrap_fails_fast(pair: EnginePair) -> None:
    t0 = time.monotonic()
    status, body = jcall("POST", pair.decode.url + "/generate",
                         {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(),
                          "bootstrap_room": 5})
    assert time.monotonic() - t0 < 0.9
    assert status == 500 and "Could not fetch prefill parallel info" in body["message"]


# disconnect, abort, introspection

def _raw_send_and_close(port: int, body: dict[str, Any], hold_s: float) -> None:
    data = orjson.dumps(body)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d"
                  b"\r\n\r\n%s" % (len(data), data))
        time.sleep(hold_s)


def test_non_stream_disconnect_is_recorded(pair: EnginePair) -> None:
    _raw_send_and_close(pair.decode.port, {"text": "hi", "rid": "gone-1", **pair.bootstrap_fields(90)}, 0.1)
    time.sleep(0.5)
    rec = records(pair.decode.url, "gone-1")[0]
    assert rec["outcome"] == "client_disconnected"
    assert rec["connection_closed"] is not None and rec["end"] >= rec["connection_closed"]
    assert rec["end"] - rec["connection_closed"] <= 0.35  # the next 0.2 s poll
    assert {"rid", "bootstrap_room", "arrival", "end", "outcome", "connection_closed", "role", "path",
            "prompt_tokens", "status"} <= set(rec)
    assert jcall("GET", pair.decode.url + "/emu/state")[1]["inflight"] == []


def test_abort_request_prefix_match(pair: EnginePair) -> None:
    async def go() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s:
            req = asyncio.ensure_future(s.post(pair.decode.url + "/generate",
                                               json={"text": "hi", "rid": "tenant-x-42", **pair.bootstrap_fields(91)}))
            await asyncio.sleep(0.2)
            async with s.post(pair.decode.url + "/abort_request", json={"rid": "tenant-x"}) as a:
                assert a.status == 200 and await a.read() == b""
            r = await req
            return r.status, await r.json()

    status, body = asyncio.run(go())
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
    assert records(pair.decode.url, "tenant-x")[0]["outcome"] == "aborted"


# faults

def test_fault_fail_is_scoped_by_count_and_path(pair: EnginePair) -> None:
    status, added = jcall("POST", pair.decode.url + "/emu/faults",
                          {"action": "fail", "status": 503, "delay_ms": 50, "path": "/generate", "count": 1})
    assert status == 200 and added["faults"][0]["action"] == "fail"
    body = {"text": "hi", "bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
    t0 = time.monotonic()
    status, out = jcall("POST", pair.decode.url + "/generate", body)
    assert status == 503 and out["code"] == 503 and time.monotonic() - t0 >= 0.05
    assert jcall("POST", pair.decode.url + "/generate", body)[0] == 200  # count exhausted
    assert jcall("GET", pair.decode.url + "/emu/faults")[1]["faults"] == []


def test_fault_drop_after_chunks(pair: EnginePair) -> None:
    jcall("POST", pair.decode.url + "/emu/faults", {"action": "drop", "after_chunks": 2})
    body = {"input_ids": [1, 2, 3], "stream": True, "bootstrap_host": "2.2.2.2", "bootstrap_room": 0,
            "sampling_params": {"max_new_tokens": 10}}

    async def go() -> tuple[bytes, bool]:
        got = b""
        async with aiohttp.ClientSession() as s:
            async with s.post(pair.decode.url + "/generate", json=body) as r:
                try:
                    async for chunk in r.content.iter_any():
                        got += chunk
                except aiohttp.ClientPayloadError:
                    return got, True
        return got, False

    got, broken = asyncio.run(go())
    assert broken and got.count(b"data: ") == 2 and b"[DONE]" not in got


def test_fault_hang_and_health_and_slow_first_token(pair: EnginePair) -> None:
    url = pair.decode.url
    jcall("POST", url + "/emu/faults", {"faults": [{"action": "health", "count": 1},
                                                   {"action": "hang", "rid_prefix": "hang-"},
                                                   {"action": "slow_first_token", "delay_ms": 300,
                                                    "rid_prefix": "slow-"}]})
    assert call("GET", url + "/health")[0] == 503
    assert call("GET", url + "/health")[0] == 200
    with pytest.raises(asyncio.TimeoutError):
        call("POST", url + "/generate", {"text": "x", "rid": "hang-1", "bootstrap_host": "2.2.2.2",
                                         "bootstrap_room": 0}, timeout=0.3)
    time.sleep(0.1)
    assert records(url, "hang-1")[0]["outcome"] == "client_disconnected"
    t0 = time.monotonic()
    assert call("POST", url + "/generate", {"text": "x", "rid": "slow-1", "bootstrap_host": "2.2.2.2",
                                            "bootstrap_room": 0})[0] == 200
    assert time.monotonic() - t0 >= 0.3


def test_fault_refuse_bootstrap(pair: EnginePair) -> None:
    jcall("POST", pair.prefill.url + "/emu/faults", {"action": "refuse_bootstrap"})
    # The fault also closes established KV connections; a decode that has not yet seen its one close fails on it.
    status, body = jcall("POST", pair.decode.url + "/generate", {"text": "hi", **pair.bootstrap_fields(92)})
    assert status == 500
    assert any(m in body["message"] for m in ("Could not fetch prefill parallel info", "prefill was lost"))
    jcall("POST", pair.prefill.url + "/emu/reset")
    (ps, _), (ds, _) = pd_request(pair, "/generate", {"text": "hi"}, room=93)
    assert ps == ds == 200


def test_bad_fault_is_400(pair: EnginePair) -> None:
    assert jcall("POST", pair.decode.url + "/emu/faults", {"action": "explode"})[0] == 400


def test_stream_disconnect_aborts_after_delay(pair: EnginePair) -> None:
    body = {"text": "hi", "rid": "gone-stream", "stream": True, **pair.bootstrap_fields(94)}
    _raw_send_and_close(pair.decode.port, body, 0.1)  # headers arrive at once; the transfer never comes
    time.sleep(0.5)
    rec = records(pair.decode.url, "gone-stream")[0]
    assert rec["outcome"] == "client_disconnected"
    assert 0.15 <= rec["end"] - rec["connection_closed"] <= 0.4  # stream_abort_delay_s = 0.2
    assert jcall("GET", pair.decode.url + "/emu/state")[1]["used_tokens"] == 0
