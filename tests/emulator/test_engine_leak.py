"""The §2.6 bug class on an emulated PD pair, driven like a naive router (both halves at once, same room)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import pd_request, records

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MARKER = "ZEBRA-7731-SECRET"
PROMPT_A = "Note: " + MARKER + " belongs to tenant A. " + "Account notes follow. " * 10
CTX = 16384
FAST = {"health_delay_s": 0, "bootstrap_timeout_s": 5, "waiting_timeout_s": 5}


def long_prompt(words: int) -> str:
    return "lorem " * words


def pd(pair: EnginePair, path: str, body: dict[str, Any], room: int) -> tuple[tuple[int, Any], tuple[int, Any]]:
    (ps, pb), (ds, db) = pd_request(pair, path, body, room)
    return (ps, orjson.loads(pb)), (ds, orjson.loads(db))


@pytest.fixture(scope="module")
def small_prefill_bug() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=512, decode_pool=4096, context_length=CTX, bug=True, **FAST) as pair:
        yield pair


@pytest.fixture(scope="module")
def small_prefill_fixed() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=512, decode_pool=4096, context_length=CTX, bug=False, **FAST) as pair:
        yield pair


@pytest.fixture(scope="module")
def small_decode_bug() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=4096, decode_pool=512, context_length=CTX, bug=True, **FAST) as pair:
        yield pair


def _send_a(pair: EnginePair) -> None:
    (ps, _), (ds, _) = pd(pair, "/generate", {"text": PROMPT_A, "sampling_params": {"max_new_tokens": 8},
                                              "rid": "req-A"}, room=101)
    assert (ps, ds) == (200, 200)


def test_marker_leaks_to_over_pool_request_in_bug_mode(small_prefill_bug: EnginePair) -> None:
    _send_a(small_prefill_bug)
    body = {"text": long_prompt(1000), "sampling_params": {"max_new_tokens": 64}, "rid": "req-B"}
    (ps, pbody), (ds, dbody) = pd(small_prefill_bug, "/generate", body, room=102)
    assert ps == 200 and pbody["meta_info"]["prompt_tokens"] == 1  # the one-token stub
    assert pbody["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert ds == 200, dbody
    assert MARKER in dbody["text"]
    dec = records(small_prefill_bug.decode.url, "req-B")[0]
    assert dbody["meta_info"]["prompt_tokens"] == dec["prompt_tokens"] >= 1000  # the real L, not the stub's 1
    assert dec["transferred_tokens"] == 1 and dec["outcome"] == "finished"


def test_chat_leak_reports_real_prompt_tokens(small_prefill_bug: EnginePair) -> None:
    _send_a(small_prefill_bug)
    body = {"messages": [{"role": "user", "content": long_prompt(900)}], "max_tokens": 64}
    (ps, _), (ds, dbody) = pd(small_prefill_bug, "/v1/chat/completions", body, room=103)
    assert (ps, ds) == (200, 200)
    assert MARKER in dbody["choices"][0]["message"]["content"]
    assert dbody["usage"]["prompt_tokens"] > 900


def test_fixed_mode_rejects_before_transfer(small_prefill_fixed: EnginePair) -> None:
    _send_a(small_prefill_fixed)
    body = {"text": long_prompt(1000), "sampling_params": {"max_new_tokens": 64}, "rid": "req-B"}
    (ps, pbody), (ds, dbody) = pd(small_prefill_fixed, "/generate", body, room=202)
    assert ps == 400 and ds == 400
    assert "exceeds the maximum allowed length" in dbody["error"]["message"]
    assert MARKER not in orjson.dumps(dbody).decode()
    assert records(small_prefill_fixed.decode.url, "req-B")[0]["transferred_tokens"] is None


def test_both_reject_gives_decode_400_after_handoff(small_prefill_bug: EnginePair) -> None:
    body = {"input_ids": [5] * 5000, "sampling_params": {"max_new_tokens": 8}, "rid": "req-both"}
    (ps, _), (ds, dbody) = pd(small_prefill_bug, "/generate", body, room=104)
    assert ps == 200 and ds == 400
    assert dbody == {"error": {"message": "Input length (5000 tokens) exceeds the maximum allowed length "
                                          "(4090 tokens). Use a shorter input or enable --allow-auto-truncate."}}
    assert records(small_prefill_bug.decode.url, "req-both")[0]["transferred_tokens"] == 1


def test_only_decode_rejects(small_decode_bug: EnginePair) -> None:
    body = {"text": long_prompt(1000), "sampling_params": {"max_new_tokens": 8}, "rid": "req-dec"}
    (ps, pbody), (ds, _) = pd(small_decode_bug, "/generate", body, room=301)
    assert ps == 200 and pbody["meta_info"]["prompt_tokens"] >= 1000
    assert ds == 400
    # the prefill computed the whole prompt but the handoff was truncated to the decode's 1-token stub
    assert records(small_decode_bug.prefill.url, "req-dec")[0]["transferred_tokens"] == 1


def test_context_length_rejected_by_tokenizer_layer(small_prefill_bug: EnginePair) -> None:
    body = {"input_ids": [5] * CTX, "sampling_params": {"max_new_tokens": 8}}
    (ps, pbody), (ds, dbody) = pd(small_prefill_bug, "/generate", body, room=105)
    assert ps == ds == 400
    assert dbody["error"]["message"] == (f"The input ({CTX} tokens) is longer than the model's context length "
                                         f"({CTX} tokens).")
