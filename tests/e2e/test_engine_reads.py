"""What the gateway reads of an engine is bounded: one streamed event, and prefill's whole answer. An engine past a
cap fails the request with 502 (never 200), is blamed for it (its breaker), and never stalls the event loop; an
abort reported as a finish-reason object is an abort on every route."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.engine.harness import EnginePair
from routing.breaker import BreakerState
from tests.engine_records import inject, reset
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

HUGE = 50 * 10**6  # what a hostile tester streamed: one 50 MB event without a blank line
CHAT = {"model": "glm-5", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello there"}]}


@pytest.fixture
def gateway(glm_pair: EnginePair, tmp_path: Path) -> Iterator[RunningGateway]:
    reset(glm_pair.prefill, glm_pair.decode)
    # One failure opens a breaker, so the state says which engine the failure was blamed on.
    entry = model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode],
                        circuit_breaker={"failure_threshold": 1, "success_threshold": 1, "open_s": 60})
    with running_gateway(write_config(tmp_path, [entry], timeouts={"first_token_s": 5.0})) as running:
        yield running
    reset(glm_pair.prefill, glm_pair.decode)


def _breakers(gateway: RunningGateway) -> tuple[BreakerState, BreakerState]:
    pool = gateway.gateway.models["glm-5"].pool
    return pool.prefill[0].breaker_state, pool.decode[0].breaker_state


def _while_probing_healthz(gateway: RunningGateway, send: Callable[[], httpx.Response],
                          ) -> tuple[httpx.Response, list[float]]:
    """Run `send()` in a thread while /healthz is asked every 5 ms; its answer and every probe's latency."""
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(send()))
    latencies: list[float] = []
    with httpx.Client(base_url=gateway.url, timeout=10) as probe:
        probe.get("/healthz")
        thread.start()
        while thread.is_alive() or len(latencies) < 5:
            started = time.perf_counter()
            assert probe.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)
    thread.join()
    return result[0], latencies


@pytest.mark.parametrize("stream", [True, False])
def test_a_decode_streaming_one_huge_unterminated_event_gets_502_without_stalling_healthz(
        gateway: RunningGateway, glm_pair: EnginePair, stream: bool) -> None:
    inject(glm_pair.decode, action="huge", size=HUGE, rid_prefix="kvg-", count=1)
    response, latencies = _while_probing_healthz(gateway, lambda: httpx.post(
        gateway.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=60))
    # Unbounded, each chunk re-joined and re-searched the whole event: seconds of stall. Bounded, a few ms; the
    # margin is for another test run sharing the two cores.
    assert max(latencies) < 0.1 * 2.5, sorted(latencies)[-5:]
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "decode_answer_too_large"
    assert _breakers(gateway) == (BreakerState.CLOSED, BreakerState.OPEN)  # the decode's fault, not the prefill's


def test_a_prefill_answering_a_huge_body_gets_502_and_is_blamed(gateway: RunningGateway,
                                                                  glm_pair: EnginePair) -> None:
    inject(glm_pair.prefill, action="huge", size=HUGE, rid_prefix="kvg-", count=1)
    response, latencies = _while_probing_healthz(gateway, lambda: httpx.post(
        gateway.url + "/v1/chat/completions", json=CHAT, timeout=60))
    assert max(latencies) < 0.1 * 2.5, sorted(latencies)[-5:]
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "prefill_answer_too_large"
    assert _breakers(gateway) == (BreakerState.OPEN, BreakerState.CLOSED)


@pytest.mark.parametrize(("half", "stream", "path"), [("decode", True, "/v1/chat/completions"),
                                                     ("decode", False, "/v1/completions"),
                                                     ("prefill", False, "/v1/chat/completions")])
def test_a_finish_reason_abort_object_in_an_openai_choice_is_never_a_200(
        gateway: RunningGateway, glm_pair: EnginePair, half: str, stream: bool, path: str) -> None:
    engine = glm_pair.decode if half == "decode" else glm_pair.prefill
    inject(engine, action="abort_object", message="scheduler aborted it", status=500, rid_prefix="kvg-", count=1)
    body = {**CHAT, "stream": stream} if "chat" in path else {
        "model": "glm-5", "prompt": "Hello there", "max_tokens": 8, "stream": stream}
    response = httpx.post(gateway.url + path, json=body, timeout=30)
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == f"{half}_failed"


@pytest.mark.parametrize("half", ["decode", "prefill"])
def test_the_caps_are_the_models_own(glm_pair: EnginePair, tmp_path: Path, half: str) -> None:
    """200 kB is far below the defaults (a 200 kB event without its end is merely broken); under caps of 64 KiB
    it is too large."""
    reset(glm_pair.prefill, glm_pair.decode)
    entry = model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode],
                        limits={"engine_event_bytes": 65536, "engine_answer_bytes": 65536})
    with running_gateway(write_config(tmp_path, [entry], timeouts={"first_token_s": 5.0})) as gateway:
        ordinary = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)
        assert ordinary.status_code == 200 and ordinary.text.endswith("data: [DONE]\n\n")
        inject(getattr(glm_pair, half), action="huge", size=200_000, rid_prefix="kvg-", count=1)
        response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert response.status_code == 502 and response.json()["error"]["code"] == f"{half}_answer_too_large"
    reset(glm_pair.prefill, glm_pair.decode)
