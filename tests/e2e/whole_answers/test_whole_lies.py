"""A lying decode's whole answer (non-streaming client) — what the gateway checks must be what a client's
JSON parser reads. Real HTTP: emulated engines, a rewriting proxy in front of decode, a real kvgate."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.e2e.whole_answers.lying_proxy import LyingProxy
from tests.gateway_harness import model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=15)
_COUNT = re.compile(rb'"prompt_tokens":(\d+)')


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EnginePair, LyingProxy, Any]]:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5", version="0.5.23",
                    bug=False) as pair:
        proxy = LyingProxy(pair.decode.url).start()
        try:
            entry = model_entry("glm-5", [pair.prefill], [proxy])
            with running_gateway(write_config(tmp_path_factory.mktemp("g"), [entry])) as gateway:
                yield pair, proxy, gateway
        finally:
            proxy.stop()


def _ask(gateway: Any, route: str = "/generate") -> httpx.Response:
    if route == "/generate":
        body: dict[str, Any] = {"text": "Hello there, how are you?", "sampling_params": {"max_new_tokens": 4}}
    else:
        body = {"model": "glm-5", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
    return httpx.post(gateway.url + route, json=body, timeout=30)


def _client_counts(response: httpx.Response) -> Any:
    """prompt_tokens as a client's JSON parser reads it."""
    doc = json.loads(response.content)
    return (doc.get("meta_info") or doc.get("usage") or {}).get("prompt_tokens")


def _lie(proxy: LyingProxy, replace: Any) -> None:
    proxy.rewrite = lambda body: _COUNT.sub(replace, body)


@pytest.fixture(autouse=True)
def _honest_again(setup: tuple[EnginePair, LyingProxy, Any]) -> Iterator[None]:
    yield
    setup[1].rewrite = None


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
@pytest.mark.parametrize("lie", [
    pytest.param(lambda m: m[0] + b',"prompt_tokens" :999', id="duplicate-key-space-before-colon"),
    pytest.param(lambda m: m[0] + b"e1", id="exponent"),
    pytest.param(lambda m: m[0] + b".9", id="fraction"),
])
def test_a_count_the_client_reads_differently_never_passes(setup: tuple[EnginePair, LyingProxy, Any], route: str,
                                                           lie: Any) -> None:
    _, proxy, gateway = setup
    honest = _ask(gateway, route)
    assert honest.status_code == 200
    counted = int(honest.headers["x-kvgate-prompt-tokens"])
    assert _client_counts(honest) == counted
    _lie(proxy, lie)
    answer = _ask(gateway, route)
    # Either the gateway refuses it, or what the client reads is the gateway's own count.
    assert answer.status_code != 200 or _client_counts(answer) == counted, (answer.status_code, answer.text[:400])


def test_only_a_spaced_key_is_not_a_count_reported(setup: tuple[EnginePair, LyingProxy, Any]) -> None:
    """The only count decode gives is spelled with a space before its colon (valid JSON): a client reads 999."""
    _, proxy, gateway = setup
    _lie(proxy, lambda m: b'"prompt_tokens" :999')
    answer = _ask(gateway)
    assert answer.status_code != 200 or _client_counts(answer) == int(answer.headers["x-kvgate-prompt-tokens"]), \
        (answer.status_code, answer.text[:300])


def _splice_meta(extra: bytes) -> Any:
    """Put `extra` (JSON members) at the end of meta_info / usage (both end the emulator's answer body)."""
    def rewrite(body: bytes) -> bytes:
        return _COUNT.sub(lambda m: m[0] + extra, body, count=1)
    return rewrite


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
@pytest.mark.parametrize("rewrite", [
    pytest.param(lambda b: b[:-7], id="truncated"),
    pytest.param(lambda b: b + b" xyz", id="trailing-garbage"),
    pytest.param(lambda b: b"[" + b + b"]", id="a-list"),
    pytest.param(lambda b: b"", id="empty"),
    pytest.param(lambda b: b"\xef\xbb\xbf" + b, id="bom"),
    pytest.param(lambda b: b[:-1] + b',"error":{"message":"boom","code":500}}', id="error-member"),
    pytest.param(lambda b: b[:-1] + b',"\\u0065rror":{"message":"boom"}}', id="escaped-error-member"),
    pytest.param(lambda b: b[:-1] + b',"object":"error"}', id="object-error-duplicate"),
    pytest.param(lambda b: _COUNT.sub(lambda m: m[0] + b',"prompt\\u005ftokens":999', b), id="escaped-key-dup"),
    pytest.param(lambda b: b[:-1] + b',"meta_info":{"prompt_tokens":999},"usage":{"prompt_tokens":999}}',
                 id="duplicate-holder"),
    pytest.param(lambda b: _COUNT.sub(lambda m: m[0] + b"0" * 30, b), id="huge-int"),
    pytest.param(lambda b: _COUNT.sub(lambda m: b'"prompt_tokens":-' + m[1], b), id="negative"),
    pytest.param(lambda b: _COUNT.sub(lambda m: b'"prompt_tokens":true', b), id="bool"),
    pytest.param(lambda b: _COUNT.sub(lambda m: b'"prompt_tokens":"' + m[1] + b'"', b), id="string"),
])
def test_held_a_broken_or_lying_whole_answer_is_never_a_200(setup: tuple[EnginePair, LyingProxy, Any], route: str,
                                                            rewrite: Any) -> None:
    _, proxy, gateway = setup
    proxy.rewrite = rewrite
    answer = _ask(gateway, route)
    assert answer.status_code >= 500, (answer.status_code, answer.text[:300])
    assert "error" in answer.json()


@pytest.mark.parametrize("finish", [b'"finish_reason":"abort"', b'"finish_reason":"ab\\u006frt"',
                                    b'"finish_reason":{"type":"ab\\u006frt","message":"x"}'])
def test_held_an_abort_however_spelled_is_never_a_200(setup: tuple[EnginePair, LyingProxy, Any],
                                                       finish: bytes) -> None:
    _, proxy, gateway = setup
    proxy.rewrite = lambda b: re.sub(rb'"finish_reason":("[a-z]+"|\{[^{}]*\})', finish.replace(b"\\", b"\\\\"), b)
    answer = _ask(gateway, "/v1/chat/completions")
    assert answer.status_code >= 400, (answer.status_code, answer.text[:300])


@pytest.mark.parametrize("rewrite", [
    pytest.param(None, id="ok"),
    pytest.param(lambda b: b[:-7], id="not-json"),
    pytest.param(lambda b: _COUNT.sub(lambda m: b'"prompt_tokens":999', b), id="miscount"),
    pytest.param(lambda b: b[:-1] + b',"error":{"message":"boom","code":500}}', id="error-member"),
])
def test_an_exchange_is_freed_by_refcount_not_left_to_the_cyclic_collector(
        setup: tuple[EnginePair, LyingProxy, Any], rewrite: Any) -> None:
    """42cc7e7: "exchanges free themselves on close" — on every path of a whole answer, failures included."""
    import gc

    from gateway.pd.exchange import PDExchange
    _, proxy, gateway = setup
    proxy.rewrite = rewrite
    _ask(gateway)  # warm
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            _ask(gateway)
        import time
        time.sleep(0.5)  # every exchange closed
        wait_for_closed = [o for o in gc.get_objects() if isinstance(o, PDExchange)]
        left = [e for e in wait_for_closed if e.finished_at is not None]
    finally:
        gc.enable()
    assert not left, f"{len(left)} closed exchanges still alive (in reference cycles); outcomes: " \
                     f"{[e.outcome for e in left]}"


@pytest.mark.parametrize("lie", [
    pytest.param(lambda m: m[0] + b',"prompt_tokens" :999', id="duplicate-key-space-before-colon"),
    pytest.param(lambda m: m[0] + b"e1", id="exponent"),
])
def test_a_streamed_count_the_client_reads_differently_never_passes(setup: tuple[EnginePair, LyingProxy, Any],
                                                                    lie: Any) -> None:
    """The same regex reads a stream's events (before 42cc7e7 as well)."""
    _, proxy, gateway = setup
    _lie(proxy, lie)
    proxy.rewrite_streams = True
    try:
        body = {"model": "glm-5", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}}
        answer = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    finally:
        proxy.rewrite_streams = False
    counted = int(answer.headers.get("x-kvgate-prompt-tokens", "-1"))
    usages = [json.loads(line[6:]).get("usage") for line in answer.text.splitlines()
              if line.startswith("data: {")]
    seen = {u["prompt_tokens"] for u in usages if u}
    assert b'"code":"prompt_token_mismatch"' in answer.content or b'"code":"decode_failed"' in answer.content \
        or seen <= {counted}, (seen, counted, answer.text[-300:])


@pytest.mark.parametrize(("route", "body"), [
    ("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "n": 2}}),
    ("/v1/chat/completions", {"model": "glm-5", "messages": [{"role": "user", "content": "a"}], "n": 2}),
    ("/v1/completions", {"model": "glm-5", "prompt": ["a", "b"], "max_tokens": 2}),
    ("/generate", {"text": "a", "stream": "false"}),
    ("/generate", {"text": "a", "stream": 0}),
])
def test_held_a_request_whose_whole_answer_would_be_a_list_or_ambiguous_is_refused_up_front(
        setup: tuple[EnginePair, LyingProxy, Any], route: str, body: dict[str, Any]) -> None:
    _, proxy, gateway = setup
    seen = len(proxy.seen)
    answer = httpx.post(gateway.url + route, json=body, timeout=30)
    assert answer.status_code == 400, answer.text[:300]
    assert len(proxy.seen) == seen  # no engine saw it
