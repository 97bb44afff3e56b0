"""Cache-aware routing over real HTTP: two emulated prefills that keep a radix cache and publish KV events as SGLang
0.5.23 does, one decode. Conversations stay where their KV is and the engines confirm the hits; an eviction the
engine reports shows at the next pick; a client's cache salt (a tenant's namespace) never routes by another's pages;
configured endpoints win over discovery; `kv_events: off` routes by what kvgate sent."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.engine.harness import RunningEngine, free_port, start_engine
from routing.prefix_index import CacheMode
from tests.engine_records import generation_records, reset, wait_for
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=12)

SYSTEM = "You are the archivist of a harbor town. " + "Keep every answer short and plain. " * 6


def events_config() -> dict[str, str]:
    return {"publisher": "zmq", "endpoint": f"tcp://*:{free_port()}", "replay_endpoint": f"tcp://*:{free_port()}",
            "topic": ""}


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[list[RunningEngine], RunningEngine]]:
    prefills = [start_engine("prefill", pool_tokens=40_000, context_length=8192, model="glm-5", version="0.5.23",
                             bug=False, kv_events_config=events_config(), enable_cache_report=True) for _ in range(2)]
    decode = start_engine("decode", pool_tokens=40_000, context_length=8192, model="glm-5", version="0.5.23",
                          bug=False, bootstrap_port=prefills[0].bootstrap_port)
    try:
        yield prefills, decode
    finally:
        for engine in [decode, *prefills]:
            engine.stop()


def gateway_for(engines: tuple[list[RunningEngine], RunningEngine], directory: Path, *,
                routing: dict[str, Any] | None = None, prefill: list[dict[str, Any]] | None = None) -> Any:
    prefills, decode = engines
    for engine in prefills:
        assert httpx.post(engine.url + "/flush_cache", timeout=10).status_code == 200
    reset(*prefills, decode)
    entry = model_entry("glm-5", prefills, [decode],
                        routing={"prefill_policy": "cache_aware", "decode_policy": "kv_headroom", **(routing or {})})
    if prefill is not None:
        entry["prefill"] = prefill
    return running_gateway(write_config(directory, [entry]))


def counter(gateway: RunningGateway, name: str) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    found = re.search(rf'^{name}_total{{model="glm-5"}} ([0-9.e+]+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def chat(gateway: RunningGateway, messages: list[dict[str, str]], **extra: Any) -> None:
    response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30,
                          json={"model": "glm-5", "messages": messages, "max_tokens": 4, **extra})
    assert response.status_code == 200, response.text


def predicted_for(gateway: RunningGateway, messages: list[dict[str, str]], **extra: Any) -> float:
    before = counter(gateway, "kvgate_route_cached_tokens_predicted")
    chat(gateway, messages, **extra)
    return counter(gateway, "kvgate_route_cached_tokens_predicted") - before


def modes(gateway: RunningGateway) -> list[CacheMode]:
    return [w.cache_index.mode for w in gateway.gateway.models["glm-5"].pool.prefill if w.cache_index is not None]


def conversation(user: int, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"User {user}, question {turn}: " + "where is the old mill? " * 12})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": "Past the bridge, by the river. " * 10})
    return messages


def test_each_conversation_stays_where_its_kv_is_and_the_engines_confirm_the_hits(
        engines: tuple[list[RunningEngine], RunningEngine], tmp_path: Path) -> None:
    prefills, _ = engines
    with gateway_for(engines, tmp_path) as gateway:
        assert wait_for(lambda: modes(gateway) == [CacheMode.EXACT] * 2, timeout_s=10)
        for turns in range(1, 5):
            for user in range(2):
                chat(gateway, conversation(user, turns))
        placed = [[r for r in generation_records(engine) if r.get("prompt_tokens")] for engine in prefills]
        assert [len(p) for p in placed] == [4, 4]  # one conversation per prefill, every turn on it
        for records in placed:
            lengths = [r["prompt_tokens"] for r in records]
            assert lengths == sorted(lengths)  # one conversation growing turn by turn
            assert all(r["cached_tokens"] > 0 for r in records[1:])  # every next turn reused the last one's KV
        predicted = counter(gateway, "kvgate_route_cached_tokens_predicted")
        reported = counter(gateway, "kvgate_prefill_cached_tokens")
        assert 0 < predicted <= reported  # block-rounded down: never more than the engines found
        assert reported - predicted <= 6 * 31  # and at most one block short per later turn
        assert counter(gateway, "kvgate_prefilled_prompt_tokens") > reported


def test_an_eviction_the_engine_reports_shows_at_the_next_pick_and_kv_events_off_does_not_see_it(
        engines: tuple[list[RunningEngine], RunningEngine], tmp_path: Path) -> None:
    prefills, _ = engines
    for kv_events, after_flush_predicts in (("auto", False), ("per_block", False), ("off", True)):
        with gateway_for(engines, tmp_path, routing={"kv_events": kv_events}) as gateway:
            expected_mode = CacheMode.APPROXIMATE if kv_events == "off" else CacheMode.EXACT
            assert wait_for(lambda: modes(gateway) == [expected_mode] * 2, timeout_s=10)
            indexes = [w.cache_index for w in gateway.gateway.models["glm-5"].pool.prefill]
            assert all(i is not None and i.per_block_evictions == (kv_events == "per_block") for i in indexes)
            chat(gateway, conversation(7, 1))
            assert predicted_for(gateway, conversation(7, 2)) > 0
            for engine in prefills:  # the engine empties its cache (AllBlocksCleared)
                assert httpx.post(engine.url + "/flush_cache", timeout=10).status_code == 200
            if kv_events != "off":
                pool = gateway.gateway.models["glm-5"].pool
                assert wait_for(lambda: all(w.cache_index.held_blocks == 0 for w in pool.prefill), timeout_s=5)
            assert (predicted_for(gateway, conversation(7, 3)) > 0) is after_flush_predicts


def test_a_cache_salt_never_routes_by_another_namespaces_pages_and_cache_aware_tokens_bounds_the_match(
        engines: tuple[list[RunningEngine], RunningEngine], tmp_path: Path) -> None:
    prefills, _ = engines
    with gateway_for(engines, tmp_path) as gateway:
        assert wait_for(lambda: modes(gateway) == [CacheMode.EXACT] * 2, timeout_s=10)
        chat(gateway, conversation(3, 2), cache_salt="team-a")
        assert predicted_for(gateway, conversation(3, 2), cache_salt="team-a") > 0
        assert predicted_for(gateway, conversation(3, 2), cache_salt="team-b") == 0  # the engine holds the same
        last = max((r for engine in prefills for r in generation_records(engine) if r.get("prompt_tokens")),
                   key=lambda r: r["arrival"])
        assert last["cached_tokens"] == 0  # ... and SGLang agrees: another namespace shares nothing
    with gateway_for(engines, tmp_path, routing={"cache_aware_tokens": 64}) as gateway:
        assert wait_for(lambda: modes(gateway) == [CacheMode.EXACT] * 2, timeout_s=10)
        chat(gateway, conversation(4, 2))
        indexes = [w.cache_index for w in gateway.gateway.models["glm-5"].pool.prefill if w.cache_index is not None]
        # Only the first 64 tokens are recorded (and so ever predicted): two blocks of 32, wherever it went.
        assert sorted(index.sent_blocks * index.block_tokens for index in indexes) == [0, 64]
        # (Where the repeat goes is the spread's call: 64 tokens of cache weigh less than a prompt's worth of load.)
        assert predicted_for(gateway, conversation(4, 2)) <= 64


def test_cache_aware_index_bytes_bounds_each_prefills_views_below_what_its_pool_claims(
        engines: tuple[list[RunningEngine], RunningEngine], tmp_path: Path) -> None:
    with gateway_for(engines, tmp_path, routing={"cache_aware_index_bytes": 1 << 20}) as gateway:
        assert wait_for(lambda: modes(gateway) == [CacheMode.EXACT] * 2, timeout_s=10)
        chat(gateway, conversation(5, 1))
        assert predicted_for(gateway, conversation(5, 2)) > 0
        for worker in gateway.gateway.models["glm-5"].pool.prefill:
            assert worker.cache_index is not None
            # 40,000 pool tokens at page size 1 would allow 80,000 pages a view; 5/8 MiB at 256 B a page: 2,560.
            assert [view._max_pages for view in worker.cache_index.ranks] == [2560]


def test_configured_kv_events_endpoints_are_the_ones_subscribed(
        engines: tuple[list[RunningEngine], RunningEngine], tmp_path: Path) -> None:
    prefills, _ = engines
    nowhere = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
               "topic": ""}
    configured = [{"url": prefills[0].url, "bootstrap_port": prefills[0].bootstrap_port, "kv_events": nowhere},
                  {"url": prefills[1].url, "bootstrap_port": prefills[1].bootstrap_port}]
    with gateway_for(engines, tmp_path, prefill=configured) as gateway:
        # The second is discovered from its /server_info; the first listens where nothing publishes.
        assert wait_for(lambda: modes(gateway) == [CacheMode.APPROXIMATE, CacheMode.EXACT], timeout_s=10)


def test_overlong_input_ids_with_bad_values_are_refused_by_their_length_not_with_a_500(
        engines: tuple[list[RunningEngine], RunningEngine], tmp_path: Path) -> None:
    with gateway_for(engines, tmp_path) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
        body = {"sampling_params": {"max_new_tokens": 1}}
        for bad in (-1, 2**40, "x", 1.5):
            overlong = client.post("/generate", json={"input_ids": [bad] + [9703] * 9000, **body})
            assert overlong.status_code == 413, overlong.text  # as without cache_aware: the length decides first
            within = client.post("/generate", json={"input_ids": [bad] + [9703] * 100, **body})
            assert within.status_code == 400, within.text
