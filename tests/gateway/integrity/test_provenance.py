"""Provenance no tenant can steer (issue 23), over real HTTP through the gateway to emulated engines. The emulator's
model echoes its prompt, so an honest answer carries the asking tenant's own text; in bug mode (0.5.8, a prefill that
lies about its pool) an over-pool prompt's answer echoes the previous request's KV instead: a real cross-tenant copy.

The poisoning: tenant A sends a likely answer (a standard refusal) as its prompt; tenant B's honest answer carries it.
That must raise nothing, while A's own unique text — sent as a string or as token ids — in B's answer still must."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.integrity.provenance import NGRAM, WINDOW, ProvenanceWindow, normalized
from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import inject, wait_for
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=12)

REFUSAL = "I'm sorry, but I can't help with that request. If you have any other questions, feel free to ask."
# B quotes it after 30 letters: an offset that is no multiple of 8, where n-grams kept every 8th position differ.
QUOTING = "Please repeat after me, word for word: " + REFUSAL
SECRETS = [  # A's own text, each long and unlike the others, none sent by anyone else
    "Note for tenant A only: the Rotterdam escrow account NL91ABNA0417164300 releases 88,123 euros to Marjolein de "
    "Vries on Thursday; quote contract 2024-ACM-0917 from the Zuidas office, room 14B, beside the 1998 merger files.",
    "Tenant A's payroll run 7731 pays the Eindhoven night shift through Rabobank batch QX-5512, approved by Pieter "
    "Hoogland after the audit of the Delft warehouse found forty-two pallets of copper missing in the second quarter.",
    "Draft settlement for tenant A: Kowalski Logistics drops claim C-90441 in exchange for the Gdansk terminal lease, "
    "signed by counsel Anneke Brouwer at the Utrecht court on the ninth, the penalty clause struck from paragraph six.",
]
LEAK_TOKENS = 96
OVER_POOL = "lorem " * 12_000  # ~12,000 tokens against a 4,096-token prefill pool: the stub's answer leaks KV


@pytest.fixture(scope="module")
def lying_pair() -> Iterator[EnginePair]:
    """Prefill pool 4,096 tokens but claiming 100,000; bug mode (0.5.8); context 16,384."""
    with start_pair(prefill_pool=4096, decode_pool=100_000, context_length=16384, model="glm-5", version="0.5.8",
                    bug=True, prefill_opts={"report_pool_tokens": 100_000}) as pair:
        yield pair


@pytest.fixture
def gateway(lying_pair: EnginePair, tmp_path: Path) -> Iterator[RunningGateway]:
    entry = model_entry("glm-5", [lying_pair.prefill], [lying_pair.decode], context_length=16384,
                        min_engine_version="0.5.8", release="immediate",
                        integrity={"provenance_sample": 1.0, "provenance_window": 100_000})
    with running_gateway(write_config(tmp_path, [entry])) as running:
        yield running


def _tenant(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {name}"}


def _generate(gateway: RunningGateway, tenant: str, body: dict[str, Any], max_new: int = 8) -> httpx.Response:
    response = httpx.post(gateway.url + "/generate", json={**body, "sampling_params": {"max_new_tokens": max_new}},
                          headers=_tenant(tenant), timeout=60)
    assert response.status_code == 200, response.text
    return response


def _counter(gateway: RunningGateway, name: str) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    line = next((ln for ln in text.splitlines() if ln.startswith(name + "{")), "")
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def _checked(gateway: RunningGateway, answers: int) -> None:
    """Wait until the checker's thread has judged that many answers."""
    assert wait_for(lambda: _counter(gateway, "kvgate_provenance_checks_total") == answers, timeout_s=10)


def _leak_into_b(gateway: RunningGateway, pair: EnginePair) -> str:
    """B's over-pool prompt: the prefill reports the full count (verify-then-release sees nothing) and decode answers
    from the pages the previous request left — another tenant's KV, with HTTP 200."""
    count = httpx.post(gateway.url + "/v1/tokenize", json={"prompt": OVER_POOL}, timeout=30).json()["count"]
    inject(pair.prefill, action="miscount", offset=count - 1, count=1, rid_prefix="kvg-")
    return _generate(gateway, "tenant-b", {"text": OVER_POOL}, max_new=LEAK_TOKENS).text


def test_likely_answer_text_one_tenant_sent_does_not_make_anothers_honest_answer_foreign(
        gateway: RunningGateway, lying_pair: EnginePair) -> None:
    _generate(gateway, "tenant-a", {"text": REFUSAL})  # the poison: a likely answer, sent as a prompt
    honest = _generate(gateway, "tenant-b", {"text": QUOTING}, max_new=64).json()["text"]
    assert normalized(REFUSAL) in normalized(honest)  # B's answer carries A's prompt: B asked for it
    _generate(gateway, "tenant-c", {"text": QUOTING})  # after a third tenant sent it too...
    _generate(gateway, "tenant-b", {"text": "Tell me a joke."})  # ...and B's next request
    _checked(gateway, 4)
    assert _counter(gateway, "kvgate_provenance_foreign_total") == 0
    # A real copy of A's own text still counts, in the same window.
    _generate(gateway, "tenant-a", {"text": SECRETS[0]})
    leaked = _leak_into_b(gateway, lying_pair)
    assert "Rotterdam escrow" in leaked  # the incident: another tenant's text, as a 200
    _checked(gateway, 6)
    assert _counter(gateway, "kvgate_provenance_foreign_total") == 1


def test_a_token_id_prompt_leaking_into_another_tenants_answer_is_found(
        gateway: RunningGateway, lying_pair: EnginePair) -> None:
    def ids(text: str) -> list[int]:
        tokens = httpx.post(gateway.url + "/v1/tokenize", json={"prompt": text, "add_special_tokens": False},
                            timeout=30).json()["tokens"]
        assert isinstance(tokens, list)
        return tokens

    _generate(gateway, "tenant-a", {"input_ids": ids(SECRETS[1])})  # /generate's input_ids
    assert "Eindhoven night shift" in _leak_into_b(gateway, lying_pair)
    _checked(gateway, 2)
    assert _counter(gateway, "kvgate_provenance_foreign_total") == 1
    completion = {"model": "glm-5", "prompt": ids(SECRETS[2]), "max_tokens": 8}  # a completion's token-id prompt
    response = httpx.post(gateway.url + "/v1/completions", json=completion, headers=_tenant("tenant-a"), timeout=60)
    assert response.status_code == 200, response.text
    assert "Kowalski Logistics" in _leak_into_b(gateway, lying_pair)
    _checked(gateway, 4)
    assert _counter(gateway, "kvgate_provenance_foreign_total") == 2


def test_text_two_tenants_sent_at_any_offset_is_common() -> None:
    """The window alone: common text is decided by content, wherever it stands in each prompt."""
    shared = " ".join(SECRETS)
    answer = "Here: " + shared[100:400]
    for offset in range(8):  # A and C quote it at every offset against each other
        window = ProvenanceWindow(10_000)
        window.remember("a", ["x" * offset + shared])
        assert window.foreign("b", answer) and not window.foreign("a", answer)  # only A sent it
        window.remember("c", ["Quoted: " + shared + " (end)"])
        assert not window.foreign("b", answer)  # A and C sent it: nobody's


def test_any_copied_stretch_of_ngram_plus_window_characters_is_found_wherever_it_stands() -> None:
    """Winnowing's guarantee: NGRAM + WINDOW - 1 letters and digits copied from one tenant's prompt into another's
    answer are always found, at any offset in either (a kept-by-chance scheme misses some)."""
    rng = random.Random(7)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    length = NGRAM + WINDOW - 1
    for _ in range(300):
        prompt = "".join(rng.choice(alphabet) for _ in range(400))
        start = rng.randrange(0, len(prompt) - length)
        window = ProvenanceWindow(100_000)
        window.remember("a", [prompt])
        answer = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 50))) + prompt[start:start + length]
        assert window.foreign("b", answer), (start, len(answer))


def test_a_tenant_flooding_the_window_pushes_out_its_own_prompts_not_anothers() -> None:
    rng = random.Random(11)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    secret = "".join(rng.choice(alphabet) for _ in range(400))
    window = ProvenanceWindow(2_000)
    window.remember("a", [secret])
    for _ in range(50):  # far more than the window holds, all the flooder's
        window.remember("flooder", ["".join(rng.choice(alphabet) for _ in range(2_000))])
    assert window.foreign("b", "the answer: " + secret[100:300])  # A's prompt is still remembered
