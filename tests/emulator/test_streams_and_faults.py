"""Streaming usage and response shapes per SGLang dialect, long text prompts, and the miscount / error_body faults.

Expected chunks are written out by hand from SGLang's models (pydantic `model_dump_json` field order; 0.5.22+ chat
role/content/finish chunks from msgspec's `StreamChunk`) and compared byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadtests.engine.harness import RunningEngine
from tests.emulator.helpers import VERSIONS, Reenactment, post, post_stream, start_engines, stop_all

HI = [{"role": "user", "content": "hi"}]  # 6 GLM-5 tokens with the generation prompt
NO_USAGE = object()


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, RunningEngine]]:
    engs = start_engines([("decode", {"version": v}) for v in VERSIONS] + [("prefill", {"version": "0.5.8"})])
    yield {**dict(zip(VERSIONS, engs)), "prefill": engs[-1]}
    stop_all(engs)


@pytest.fixture(autouse=True)
def _reset(engines: dict[str, RunningEngine]) -> None:
    for eng in engines.values():
        assert httpx.post(eng.url + "/emu/reset").status_code == 200


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Reenactment:
    return Reenactment(tmp_path_factory.mktemp("glm5"))


def usage(version: str, prompt: int, completion: int) -> dict[str, Any]:
    u = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
         "prompt_tokens_details": None, "reasoning_tokens": 0}
    if version == "0.5.23":
        u["completion_tokens_details"] = None
    return u


def chat_chunk(version: str, head: dict[str, Any], delta: dict[str, Any], finish: str | None = None,
               usage_: Any = NO_USAGE) -> bytes:
    """0.5.8: pydantic ChatCompletionStreamResponse, every field present; 0.5.22+: msgspec StreamChunk, usage only
    when set and reasoning_content leading the delta."""
    if version == "0.5.8":
        full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None, **delta}
    else:
        full = {"reasoning_content": None, **delta}
    chunk = {**head, "choices": [{"index": 0, "delta": full, "logprobs": None, "finish_reason": finish,
                                  "matched_stop": None}]}
    if version == "0.5.8" or usage_ is not NO_USAGE:
        chunk["usage"] = None if usage_ is NO_USAGE else usage_
    return orjson.dumps(chunk)


def head_of(payload: bytes, obj: str) -> dict[str, Any]:
    got = orjson.loads(payload)
    return {"id": got["id"], "object": obj, "created": got["created"], "model": "default"}


@pytest.mark.parametrize("version", VERSIONS)
def test_long_text_prompts_are_counted(engines: Any, sglang: Reenactment, version: str) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 900  # ~40,000 characters: encoded off the loop
    assert len(text) > 40_000
    expected = len(sglang.text_ids(text))
    status, out = post(engines[version], "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and out["meta_info"]["prompt_tokens"] == expected, out
    status, out = post(engines[version], "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert status == 200 and out["usage"]["prompt_tokens"] == expected, out


@pytest.mark.parametrize("version", VERSIONS)
def test_chat_stream_with_usage_options(engines: Any, version: str) -> None:
    body = {"messages": HI, "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, events = post_stream(engines[version], "/v1/chat/completions", body)
    assert status == 200 and len(events) == 1 + 3 + 1 + 1
    head = head_of(events[0], "chat.completion.chunk")
    assert events[0] == chat_chunk(version, head, {"role": "assistant", "content": ""})  # the role chunk: no usage
    for i, event in enumerate(events[1:4]):
        text = orjson.loads(event)["choices"][0]["delta"]["content"]
        assert event == chat_chunk(version, head, {"content": text}, usage_=usage(version, 6, i + 1))
    assert events[4] == chat_chunk(version, head, {}, "length")
    assert events[5] == orjson.dumps({**head, "choices": [], "usage": usage(version, 6, 3)})


@pytest.mark.parametrize("version", VERSIONS)
def test_chat_stream_without_usage_options(engines: Any, version: str) -> None:
    status, events = post_stream(engines[version], "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert status == 200 and len(events) == 1 + 2 + 1
    head = head_of(events[0], "chat.completion.chunk")
    text = orjson.loads(events[1])["choices"][0]["delta"]["content"]
    assert events[1] == chat_chunk(version, head, {"content": text})  # 0.5.8: "usage":null; 0.5.22+: no key
    assert events[3] == chat_chunk(version, head, {}, "length")


@pytest.mark.parametrize("version", VERSIONS)
def test_completion_stream_with_usage_options(engines: Any, sglang: Reenactment, version: str) -> None:
    prompt = "Once upon a time"
    n = len(sglang.text_ids(prompt))
    body = {"prompt": prompt, "max_tokens": 2, "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True}}
    status, events = post_stream(engines[version], "/v1/completions", body)
    assert status == 200 and len(events) == 3
    head = head_of(events[0], "text_completion")
    for i, event in enumerate(events[:2]):
        text = orjson.loads(event)["choices"][0]["text"]
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length" if i == 1 else None,
                  "matched_stop": None}
        assert event == orjson.dumps({**head, "choices": [choice], "usage": usage(version, n, i + 1)})
    # the final chunk is model_dump_json(exclude_none=True): the null details are gone
    assert events[2] == orjson.dumps({**head, "choices": [], "usage": {
        "prompt_tokens": n, "total_tokens": n + 2, "completion_tokens": 2, "reasoning_tokens": 0}})


@pytest.mark.parametrize("version", VERSIONS)
def test_non_stream_bodies(engines: Any, version: str) -> None:
    status, out = post(engines[version], "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert status == 200
    message = {"role": "assistant", "content": out["choices"][0]["message"]["content"], "reasoning_content": None}
    if version == "0.5.8":
        message["tool_calls"] = None
    assert out["choices"][0] == {"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                                 "matched_stop": None}
    assert list(out) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert out["model"] == "default" and out["usage"] == usage(version, 6, 2)


def miscount(engine: RunningEngine, offset: int, **match: Any) -> None:
    r = httpx.post(engine.url + "/emu/faults", json={"action": "miscount", "offset": offset, **match})
    assert r.status_code == 200 and r.json()["faults"][0]["offset"] == offset


def test_miscount_shifts_every_reported_prompt_count_on_the_decode(engines: Any) -> None:
    eng = engines["0.5.8"]
    miscount(eng, 7, rid_prefix="mis-")
    status, out = post(eng, "/generate", {"input_ids": [1, 2, 3, 4], "rid": "mis-1",
                                          "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and out["meta_info"]["prompt_tokens"] == 11
    status, events = post_stream(eng, "/generate", {"input_ids": [1, 2, 3, 4], "rid": "mis-2",
                                                    "sampling_params": {"max_new_tokens": 2}})
    assert [orjson.loads(e)["meta_info"]["prompt_tokens"] for e in events] == [11, 11]
    status, out = post(eng, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "rid": "mis-3"})
    assert out["usage"]["prompt_tokens"] == 13 and out["usage"]["total_tokens"] == 15
    body = {"messages": HI, "max_tokens": 2, "rid": "mis-4",
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, events = post_stream(eng, "/v1/chat/completions", body)
    assert [orjson.loads(e)["usage"]["prompt_tokens"] for e in events if orjson.loads(e)["usage"]] == [13, 13, 13]
    status, out = post(eng, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "rid": "mis-5"})
    assert out["usage"]["prompt_tokens"] == 10
    status, out = post(eng, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "rid": "other"})
    assert out["usage"]["prompt_tokens"] == 3  # rid_prefix scopes the fault
    records = httpx.get(eng.url + "/emu/requests", params={"rid": "mis-1"}).json()["requests"]
    assert records[0]["prompt_tokens"] == 4 and records[0]["fault"] == "miscount"  # the real count is recorded


def test_miscount_on_the_prefill_with_count(engines: Any) -> None:
    eng = engines["prefill"]
    miscount(eng, -2, count=1, path="/generate")
    body = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 4}}
    assert post(eng, "/generate", body)[1]["meta_info"]["prompt_tokens"] == 3
    assert post(eng, "/generate", body)[1]["meta_info"]["prompt_tokens"] == 5  # count exhausted


def test_error_body_under_200_and_in_a_stream(engines: Any) -> None:
    eng = engines["0.5.22"]
    rule = {"action": "error_body", "path": "/v1/chat/completions", "count": 2, "message": "boom"}
    added = httpx.post(eng.url + "/emu/faults", json=rule).json()["faults"][0]
    assert added["status"] == 200 and added["code"] == 500
    error = {"object": "error", "message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    status, out = post(eng, "/v1/chat/completions", {"messages": HI, "rid": "eb-1"})
    assert status == 200 and out == error
    status, events = post_stream(eng, "/v1/chat/completions", {"messages": HI})
    assert status == 200 and events == [orjson.dumps(error)]
    assert post(eng, "/v1/chat/completions", {"messages": HI})[0] == 200  # count exhausted: a normal answer
    httpx.post(eng.url + "/emu/faults", json={"action": "error_body", "status": 503, "code": 400})
    status, out = post(eng, "/generate", {"text": "hi"})
    assert status == 503 and out == {**error, "message": "Injected fault", "type": "BadRequestError", "code": 400}
    record = httpx.get(eng.url + "/emu/requests", params={"rid": "eb-1"}).json()["requests"][0]
    assert record["fault"] == "error_body" and record["status"] == 200 and record["outcome"] == "error"


@pytest.mark.parametrize("version", VERSIONS)
def test_server_info_reports_the_pd_safety_settings_as_each_version_does(engines: dict[str, RunningEngine],
                                                                         version: str) -> None:
    info = httpx.get(engines[version].url + "/server_info").json()
    assert info["disaggregation_transfer_backend"] == "mooncake" and info["enable_metrics"] is True
    modern = version != "0.5.8"
    assert ("disaggregation_enable_kv_checksum" in info) is modern  # 0.5.22+ fields, with their defaults
    if modern:
        assert info["disaggregation_enable_kv_checksum"] is False
        assert info["disaggregation_decode_allocation_policy"] == "early"
    assert "env_vars" not in info["internal_states"][0]  # only with SGLANG_EXPOSE_OWN_ENV_VARS=1
