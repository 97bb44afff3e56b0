"""Logprobs in PD: only the prefill computes the prompt's, so the gateway prepends the prefill's
`input_token_logprobs` to the decode's answer, as SGLang's router does (merge_logprobs_in_json /
merge_streaming_logprobs), streamed and not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadtests.engine.harness import EnginePair
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
        assert events and all(len(e["meta_info"]["input_token_logprobs"]) == len(ids) for e in events)
        _check(events[-1]["meta_info"], ids, 4)
    else:
        _check(response.json()["meta_info"], ids, 4)


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
