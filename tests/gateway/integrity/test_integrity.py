"""TTFT plausibility: a line of defence behind the KV-pool gate and verify-then-release. An engine that lies about
its pool (`--report-pool-tokens`) gets prompts past the gate; in bug mode SGLang 0.5.8 prefills a one-token stub and
decode answers at once with another tenant's KV. Here the prefill also reports the full prompt count (a `miscount`
fault), so the counts agree and verify-then-release sees nothing: only the first token's timing betrays the leak —
far sooner than the prompt could be prefilled. It is counted and logged, and under `strict` the request fails
before any byte is released."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.integrity.provenance import ProvenanceWindow
from gateway.integrity.provenance_text import answer_text
from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import inject, wait_for
from tests.gateway_harness import model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=28)

MARKER = "ZEBRA-7731-SECRET"
PREFILL_TOKENS_PER_S = 20_000  # the emulated prefill's real speed
CEILING = 50_000  # what the operator states: no prefill of this model is faster


@pytest.fixture(scope="module")
def lying_pair() -> Iterator[EnginePair]:
    """Prefill pool 4,096 tokens but claiming 100,000; bug mode (0.5.8); context 16,384."""
    with start_pair(prefill_pool=4096, decode_pool=100_000, context_length=16384, model="glm-5", version="0.5.8",
                    bug=True, prefill_tokens_per_s=PREFILL_TOKENS_PER_S, token_delay_ms=5,
                    prefill_opts={"report_pool_tokens": 100_000}) as pair:
        yield pair


def _gateway(pair: EnginePair, directory: Path, *, strict: bool, min_prompt_tokens: int = 1024) -> Any:
    entry = model_entry("glm-5", [pair.prefill], [pair.decode], context_length=16384, min_engine_version="0.5.8",
                        release="immediate", integrity={"max_prefill_tokens_per_s": CEILING, "strict": strict,
                                                        "min_prompt_tokens": min_prompt_tokens})
    directory.mkdir(exist_ok=True)
    return running_gateway(write_config(directory, [entry]))


def _stream(url: str, text: str) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": 48}, "stream": True}
    return httpx.post(url + "/generate", json=body, timeout=60)


def _report_full_count(pair: EnginePair, url: str, text: str) -> None:
    """The stub's prefill will report the whole prompt's count (its own 1 + the offset): the counts agree."""
    count = httpx.post(url + "/v1/tokenize", json={"prompt": text}, timeout=30).json()["count"]
    inject(pair.prefill, action="miscount", offset=count - 1, count=1, rid_prefix="kvg-")


def _plant_marker(url: str) -> None:
    response = _stream(url, f"Note: {MARKER} belongs to tenant A. " + "Account notes follow. " * 10)
    assert response.status_code == 200


def test_an_implausibly_fast_first_token_is_counted_and_under_strict_nothing_is_released(
        lying_pair: EnginePair, tmp_path: Path) -> None:
    over_pool = "lorem " * 12_000  # ~12,000 tokens: a real prefill takes ≥ 0.24 s at the ceiling
    with _gateway(lying_pair, tmp_path / "report", strict=False) as gateway:
        _plant_marker(gateway.url)
        _report_full_count(lying_pair, gateway.url, over_pool)
        leaked = _stream(gateway.url, over_pool)
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert leaked.status_code == 200 and MARKER in leaked.text  # what the guard exists for: it looked like success
    assert 'kvgate_implausible_ttft_total{model="glm-5"} 1.0' in metrics
    with _gateway(lying_pair, tmp_path / "strict", strict=True) as gateway:
        _plant_marker(gateway.url)
        _report_full_count(lying_pair, gateway.url, over_pool)
        blocked = _stream(gateway.url, over_pool)
        fine = _stream(gateway.url, "lorem " * 2000)  # a real prefill of 2,000 tokens: plausible, not flagged
    assert blocked.status_code == 502 and blocked.json()["error"]["code"] == "implausible_ttft"
    assert MARKER not in blocked.text
    assert fine.status_code == 200 and fine.text.endswith("data: [DONE]\n\n")
    with _gateway(lying_pair, tmp_path / "short", strict=True, min_prompt_tokens=20_000) as gateway:
        _report_full_count(lying_pair, gateway.url, over_pool)
        unjudged = _stream(gateway.url, over_pool)
    assert unjudged.status_code == 200  # prompts under min_prompt_tokens are not judged


def test_the_provenance_window_finds_another_tenants_text_and_only_that() -> None:
    window = ProvenanceWindow(10_000)
    secret = ("Invoice 88123 for ACME Rotterdam is overdue; the bank account is NL91ABNA0417164300 and the PIN is "
              "4471. Call Marjolein de Vries on extension 5512 before Thursday, and quote the contract 2024-ACM-0917 "
              "signed in the Zuidas office, room 14B, next to the archive of the 1998 merger.")
    window.remember("tenant-a", [secret])
    assert window.foreign("tenant-b", "Sure! " + secret[20:250] + " anything else?")  # a long shared stretch
    assert not window.foreign("tenant-a", secret)  # one's own text is not foreign
    assert not window.foreign("tenant-b", "the bank account is")  # a short common phrase is not a match
    assert answer_text(b'data: {"text":"ab"}\n\ndata: {"text":"abc"}\n\ndata: [DONE]\n\n') == "ababc"
    assert answer_text(b'{"choices":[{"message":{"role":"assistant","content":"hi there"}}]}') == "hi there"
    assert "hi the" in answer_text(b'{"choices":[{"message":{"content":"hi the')  # cut off: still checked
    shared = "The quarterly report template: revenue, costs, margin, headcount, outlook, risks and actions."
    window.remember("tenant-a", [shared])
    window.remember("tenant-c", [shared])  # two tenants sent it: common text, nobody's secret
    assert not window.foreign("tenant-b", "Here it is. " + shared)


def test_a_sampled_answer_carrying_another_tenants_text_is_flagged(lying_pair: EnginePair, tmp_path: Path) -> None:
    entry = model_entry("glm-5", [lying_pair.prefill], [lying_pair.decode], context_length=16384,
                        min_engine_version="0.5.8", release="immediate",
                        integrity={"provenance_sample": 1.0, "provenance_window": 100_000})
    (tmp_path / "provenance").mkdir()
    with running_gateway(write_config(tmp_path / "provenance", [entry])) as gateway:
        tenant_a, tenant_b = {"authorization": "Bearer tenant-a"}, {"authorization": "Bearer tenant-b"}
        # No repeated stretch: a leak of its first 48 tokens carries ~100 distinct n-grams (one in 8 is kept).
        secret = "".join(f"Note {i}: {MARKER} belongs to tenant A, account 4471 at the Rotterdam branch. " for i in range(6))
        body = {"text": secret, "sampling_params": {"max_new_tokens": 48}, "stream": True}
        assert httpx.post(gateway.url + "/generate", json=body, headers=tenant_a, timeout=60).status_code == 200
        ordinary = {"text": "What is the capital of France?", "sampling_params": {"max_new_tokens": 8}}
        assert httpx.post(gateway.url + "/generate", json=ordinary, headers=tenant_b, timeout=60).status_code == 200

        def foreign() -> float:
            text = httpx.get(gateway.url + "/metrics", timeout=10).text
            line = next((ln for ln in text.splitlines() if ln.startswith("kvgate_provenance_foreign_total{")), "")
            return float(line.rsplit(" ", 1)[1]) if line else 0.0

        assert foreign() == 0
        over_pool = "lorem " * 12_000
        _report_full_count(lying_pair, gateway.url, over_pool)
        leaked = httpx.post(gateway.url + "/generate", json={**body, "text": over_pool}, headers=tenant_b,
                            timeout=60)
        assert leaked.status_code == 200 and MARKER in leaked.text  # the leak itself, as the incident's
        assert wait_for(lambda: foreign() == 1, timeout_s=5)  # checked off the event loop, just after the answer
        assert gateway.gateway.provenance["glm-5"].capacity == 100_000


def test_no_false_positive_over_a_thousand_ordinary_requests(tmp_path: Path) -> None:
    """Fixed-mode engines, correct pools, a realistic prefill speed; strict TTFT checking and provenance on every
    answer, 20 tenants: every request succeeds and nothing is flagged."""
    words = ["".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2 + i % 7))
             for i in range(5000)]
    with start_pair(prefill_pool=100_000, decode_pool=100_000, context_length=8192, model="glm-5", version="0.5.23",
                    bug=False, prefill_tokens_per_s=PREFILL_TOKENS_PER_S) as pair:
        entry = model_entry("glm-5", [pair.prefill], [pair.decode], integrity={
            "max_prefill_tokens_per_s": CEILING, "strict": True, "provenance_sample": 1.0})
        (tmp_path / "fp").mkdir()
        with running_gateway(write_config(tmp_path / "fp", [entry])) as gateway:
            async def run() -> list[int]:
                rng = random.Random(3)
                semaphore = asyncio.Semaphore(16)
                async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
                    async def one(i: int) -> int:
                        text = " ".join(rng.choice(words) for _ in range(rng.choice((10, 60, 300, 1500))))
                        body = {"text": text, "sampling_params": {"max_new_tokens": 8}, "stream": i % 2 == 0}
                        async with semaphore:
                            response = await client.post("/generate", json=body,
                                                         headers={"authorization": f"Bearer t{i % 20}"})
                        return response.status_code
                    return list(await asyncio.gather(*(one(i) for i in range(1000))))

            statuses = asyncio.run(run())

            def metrics_text() -> str:
                return httpx.get(gateway.url + "/metrics", timeout=10).text

            assert wait_for(lambda: 'kvgate_provenance_checks_total{model="glm-5"} 1000.0' in metrics_text(),
                            timeout_s=20)
            metrics = metrics_text()
    assert statuses.count(200) == 1000
    assert "kvgate_implausible_ttft_total{" not in metrics and "kvgate_provenance_foreign_total{" not in metrics
    assert 'kvgate_provenance_checks_total{model="glm-5"} 1000.0' in metrics
