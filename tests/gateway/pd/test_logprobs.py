"""Logprobs in PD: only the prefill computes the prompt's, so the gateway prepends the prefill's
`input_token_logprobs` to the decode's answer, as SGLang's router does (merge_logprobs_in_json), streamed and not —
once: in a stream's first event, in a whole answer; never in every cumulative event."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadtests.engine.harness import EnginePair
from tests.engine_records import wait_for
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gateway(glm_pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = write_config(tmp_path_factory.mktemp("gw"), [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode])])
    with running_gateway(config) as running:
        yield running


def _check(meta: dict[str, Any], prompt_ids: list[int], completion: int) -> None:
    prompt_part = meta["input_token_logprobs"]
    assert [entry[1] for entry in prompt_part] == prompt_ids  # the whole prompt, from the prefill
    assert prompt_part[0][0] is None and all(isinstance(e[0], float) for e in prompt_part[1:])
    assert len(meta["output_token_logprobs"]) == completion


@pytest.mark.parametrize("stream", [False, True])
def test_the_prompts_logprobs_come_from_the_prefill(gateway: RunningGateway, stream: bool) -> None:
    ids = httpx.post(gateway.url + "/v1/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True, "stream": stream}
    response = httpx.post(gateway.url + "/generate", json=body, timeout=30)
    assert response.status_code == 200
    if stream:
        events = [orjson.loads(line[6:]) for line in response.text.split("\n\n") if line.startswith("data: {")]
        assert len(events) == 4
        _check(events[0]["meta_info"], ids, 1)
        assert all(e["meta_info"]["input_token_logprobs"] == [] for e in events[1:])  # decode's own: none
        assert len(events[-1]["meta_info"]["output_token_logprobs"]) == 4
    else:
        _check(response.json()["meta_info"], ids, 4)


def _output_bytes(gateway: RunningGateway) -> float:
    metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith('kvgate_output_bytes_total{model="glm-5"}'))


def test_a_long_prompts_logprobs_are_streamed_once_and_the_bytes_are_counted(gateway: RunningGateway) -> None:
    """4,000 prompt tokens and 64 cumulative events: spliced into each event, the client got 64 copies of the
    prompt's logprobs (hundreds of MB at real sizes, none of it counted)."""
    before = _output_bytes(gateway)
    body = {"text": "hello " * 4000, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
            "return_logprob": True, "stream": True}
    response = httpx.post(gateway.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200
    payloads = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: {")]
    events = [orjson.loads(payload) for payload in payloads]
    carrying = [i for i, e in enumerate(events) if e["meta_info"]["input_token_logprobs"]]
    assert len(events) == 64 and carrying == [0] and len(events[0]["meta_info"]["input_token_logprobs"]) > 3900
    sent = sum(len(payload) for payload in payloads)
    assert sent < 3 * len(payloads[0]) + 64 * len(payloads[-1])  # one prompt list, not 64
    assert wait_for(lambda: _output_bytes(gateway) - before >= sent, timeout_s=5), (before, _output_bytes(gateway))


def test_without_return_logprob_nothing_is_merged(gateway: RunningGateway) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    meta = httpx.post(gateway.url + "/generate", json=body, timeout=30).json()["meta_info"]
    assert "input_token_logprobs" not in meta


def test_token_ids_logprob_outside_the_vocabulary_never_reach_an_engine(gateway: RunningGateway) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True,
            "token_ids_logprob": [5, 10**9]}
    response = httpx.post(gateway.url + "/generate", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "token_ids_logprob"
    body["token_ids_logprob"] = [5, 6]
    assert httpx.post(gateway.url + "/generate", json=body, timeout=30).status_code == 200
