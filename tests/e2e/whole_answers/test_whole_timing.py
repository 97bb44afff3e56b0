"""A whole answer (non-streaming client) against time and disconnects: which half answers when, a client
that leaves, `release: immediate`. Real HTTP: emulated engines, rewriting proxies in front of both halves."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.e2e.whole_answers.lying_proxy import LyingProxy
from tests.engine_records import generation_records, reset, wait_for
from tests.gateway_harness import model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=25)
_COUNT = re.compile(rb'"prompt_tokens":(\d+)')


class Setup:
    def __init__(self, pair: EnginePair, prefill: LyingProxy, decode: LyingProxy, gateways: dict[str, Any]) -> None:
        self.pair, self.prefill, self.decode, self.gateways = pair, prefill, decode, gateways


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5", version="0.5.23",
                    bug=False, token_delay_ms=20, disconnect_poll_s=0.5) as pair:
        prefill = LyingProxy(pair.prefill.url, pair.prefill.bootstrap_port).start()
        decode = LyingProxy(pair.decode.url).start()
        try:
            timeouts = {"first_token_s": 0.8, "total_s": 2.5, "prefill_s": 2.0}
            with running_gateway(write_config(tmp_path_factory.mktemp("v"), [model_entry(
                    "glm-5", [prefill], [decode])], timeouts=timeouts)) as verified, \
                 running_gateway(write_config(tmp_path_factory.mktemp("i"), [model_entry(
                    "glm-5", [prefill], [decode], release="immediate")], timeouts=timeouts)) as immediate:
                yield Setup(pair, prefill, decode, {"verified": verified, "immediate": immediate})
        finally:
            decode.stop()
            prefill.stop()


@pytest.fixture(autouse=True)
def _clean(setup: Setup) -> Iterator[None]:
    reset(setup.pair.prefill, setup.pair.decode)
    yield
    for proxy in (setup.prefill, setup.decode):
        proxy.rewrite, proxy.delay_s, proxy.status = None, 0.0, None
    for gateway in setup.gateways.values():  # every exchange closed, every lease given back
        wait_for(lambda g=gateway: not g.gateway.exchanges.running, timeout_s=5)
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        held = [line for line in metrics.splitlines() if line.startswith("kvgate_worker_in_flight{")]
        assert held and all(line.endswith(" 0.0") for line in held), held


def _body(max_new: int = 4) -> dict[str, Any]:
    return {"text": "Hello there, how are you?", "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}


def _ask(gateway: Any, max_new: int = 4) -> httpx.Response:
    return httpx.post(gateway.url + "/generate", json=_body(max_new), timeout=30)


MODES = ["verified", "immediate"]


@pytest.mark.parametrize("mode", MODES)
def test_a_slow_whole_answer_past_first_token_s_but_within_total_s_is_a_200(setup: Setup, mode: str) -> None:
    setup.decode.rewrite, setup.decode.delay_s = (lambda b: b), 1.2  # prefill answered at once: total_s bounds it
    answer = _ask(setup.gateways[mode])
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("mode", MODES)
def test_a_whole_answer_past_total_s_is_a_504_and_decode_is_aborted(setup: Setup, mode: str) -> None:
    setup.decode.rewrite, setup.decode.delay_s = (lambda b: b), 4.0
    aborts = len(setup.decode.aborts)
    answer = _ask(setup.gateways[mode])
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "total_timeout", answer.text
    wait_for(lambda: len(setup.decode.aborts) > aborts, timeout_s=3)


@pytest.mark.parametrize("mode", MODES)
def test_a_prefill_slower_than_prefill_s_fails_a_whole_answer_decode_answered(setup: Setup, mode: str) -> None:
    """(A prefill slower than first_token_s is not a failure once decode's whole answer is in, as for a stream
    whose first token is in: prefill_s bounds prefill.)"""
    setup.prefill.rewrite, setup.prefill.delay_s = (lambda b: b), 2.3  # > prefill_s 2.0, < total_s 2.5
    answer = _ask(setup.gateways[mode])
    assert answer.status_code == 504 and answer.json()["error"]["code"] != "total_timeout", answer.text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lie", [
    pytest.param((500, lambda b: b'{"error":{"message":"late failure"}}'), id="prefill-500"),
    pytest.param((200, lambda b: _COUNT.sub(lambda m: b'"prompt_tokens":' + str(int(m[1]) + 1).encode(), b)),
                 id="prefill-miscount"),
    pytest.param((200, lambda b: b[:-1] + b',"error":{"message":"x"}}'), id="prefill-error-in-200"),
])
def test_prefill_failing_after_decode_answered_whole_fails_the_request(setup: Setup, mode: str, lie: Any) -> None:
    status, rewrite = lie
    setup.prefill.rewrite, setup.prefill.delay_s, setup.prefill.status = rewrite, 0.5, status
    answer = _ask(setup.gateways[mode])
    assert answer.status_code >= 500, (answer.status_code, answer.text[:300])
    decode = wait_for(lambda: [r for r in generation_records(setup.pair.decode) if r["outcome"]], timeout_s=5)
    assert decode and decode[0]["outcome"] == "finished"  # decode had answered whole before prefill's failure


def _send_then_disconnect(gateway: Any, after_s: float, max_new: int) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    payload = orjson.dumps(_body(max_new))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
        time.sleep(after_s)


@pytest.mark.parametrize("mode", MODES)
def test_client_gone_after_prefill_answered_lets_decode_go_and_aborts_it(setup: Setup, mode: str) -> None:
    aborts, prefill_aborts = len(setup.decode.aborts), len(setup.prefill.aborts)
    _send_then_disconnect(setup.gateways[mode], after_s=0.4, max_new=100)  # ~2 s of decode; prefill at once
    decode = wait_for(lambda: [r for r in generation_records(setup.pair.decode) if r["outcome"]], timeout_s=5)
    prefill = [r for r in generation_records(setup.pair.prefill) if r["outcome"]]
    assert prefill and prefill[0]["outcome"] == "finished"
    assert decode[0]["outcome"] == "aborted", decode
    assert decode[0]["end"] - decode[0]["arrival"] < 1.5
    assert len(setup.decode.aborts) > aborts and len(setup.prefill.aborts) == prefill_aborts


@pytest.mark.parametrize("mode", MODES)
def test_client_gone_before_a_slow_prefill_answered_holds_decode_to_it(setup: Setup, mode: str) -> None:
    setup.prefill.rewrite, setup.prefill.delay_s = (lambda b: b), 0.6
    _send_then_disconnect(setup.gateways[mode], after_s=0.2, max_new=100)
    decode = wait_for(lambda: [r for r in generation_records(setup.pair.decode) if r["outcome"]], timeout_s=5)
    prefill = wait_for(lambda: [r for r in generation_records(setup.pair.prefill) if r["outcome"]], timeout_s=5)
    assert prefill[0]["outcome"] == "finished"
    # decode ran on until prefill's answer reached the gateway (0.6 s after prefill finished), then was aborted
    assert decode[0]["outcome"] == "aborted"
    assert decode[0]["end"] >= prefill[0]["end"] + 0.5, (decode, prefill)
    assert decode[0]["end"] - decode[0]["arrival"] < 1.6


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_spliced_from_prefill_carry_no_unchecked_count(setup: Setup, stream: bool) -> None:
    """/generate with return_logprob: prefill's input_token_logprobs are spliced into decode's answer after decode's
    answer was checked. A lying prefill's list must not bring a prompt count nobody verified to the client."""
    setup.prefill.rewrite = lambda b: b.replace(b'"input_token_logprobs":[',
                                                b'"input_token_logprobs":[{"prompt_tokens":999},', 1)
    body = {**_body(), "return_logprob": True, "stream": stream}
    answer = httpx.post(setup.gateways["verified"].url + "/generate", json=body, timeout=30)
    assert answer.status_code != 200 or b"999" not in answer.content, answer.text[:500]
