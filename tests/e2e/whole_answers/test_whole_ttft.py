"""Strict TTFT plausibility must hold for a client that does not stream.

Since 42cc7e7 decode answers a non-streaming client whole, and the whole answer's arrival stands for the first
token. A lying engine (bug mode, a stub prefill reporting the full count) whose decode answers at once from another
tenant's KV is caught for a streaming client; the same request, not streamed, with enough max_new_tokens that the
generation outlasts the floor, sails through `strict` with a 200 carrying the other tenant's text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import inject
from tests.gateway_harness import model_entry, running_gateway, write_config

MARKER = "ZEBRA-7731-SECRET"
CEILING = 50_000


@pytest.fixture(scope="module")
def lying_pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=4096, decode_pool=100_000, context_length=16384, model="glm-5", version="0.5.8",
                    bug=True, prefill_tokens_per_s=20_000, token_delay_ms=5,
                    prefill_opts={"report_pool_tokens": 100_000}) as pair:
        yield pair


def _gateway(pair: EnginePair, directory: Path) -> Any:
    entry = model_entry("glm-5", [pair.prefill], [pair.decode], context_length=16384, min_engine_version="0.5.8",
                        integrity={"max_prefill_tokens_per_s": CEILING, "strict": True, "min_prompt_tokens": 1024})
    directory.mkdir(exist_ok=True)
    return running_gateway(write_config(directory, [entry]))


def _post(url: str, text: str, *, stream: bool, max_new: int) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}, "stream": stream}
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_strict_ttft_blocks_a_stub_prefill_for_a_whole_answer_too(lying_pair: EnginePair, tmp_path: Path) -> None:
    over_pool = "lorem " * 12_000  # ~12,000 tokens: floor 0.24 s at the ceiling; the stub prefill answers at once
    with _gateway(lying_pair, tmp_path / "g") as gateway:
        planted = _post(gateway.url, f"Note: {MARKER} belongs to tenant A. " + "Account notes follow. " * 10,
                        stream=True, max_new=48)
        assert planted.status_code == 200
        count = httpx.post(gateway.url + "/v1/tokenize", json={"prompt": over_pool}, timeout=30).json()["count"]
        inject(lying_pair.prefill, action="miscount", offset=count - 1, count=1, rid_prefix="kvg-")
        streamed = _post(gateway.url, over_pool, stream=True, max_new=48)
        assert streamed.status_code == 502 and "implausible_ttft" in streamed.text  # holds for a stream
        inject(lying_pair.prefill, action="miscount", offset=count - 1, count=1, rid_prefix="kvg-")
        whole = _post(gateway.url, over_pool, stream=False, max_new=200)  # ~1 s of generation > the 0.24 s floor
        fine = _post(gateway.url, "lorem " * 2000, stream=False, max_new=8)  # a real 2,000-token prefill
    assert fine.status_code == 200, fine.text[:300]  # judged on prefill's answer: no false positive
    assert whole.status_code == 502, whole.text[:300]
    assert whole.json()["error"]["code"] == "implausible_ttft"
    assert MARKER not in whole.text
