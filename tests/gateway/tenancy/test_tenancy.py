"""Tenants on the default in-memory state: each tenant's requests carry its own keyed prefix-cache salt on both
halves (SGLang's extra_key), so one tenant's prompt never hits another's cached pages; tenants in one cache group
share; a client's own cache_salt or extra_key only subdivides its tenant's space and never reaches an engine as
sent. Limits answer 429 with Retry-After; without `auth.required` a request without a key is served."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterator

import httpx
import pytest
import yaml

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import records, wait_for
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol", "dave": "sk-dave", "erin": "sk-erin",
        "frank": "sk-frank"}
SECRET = "the-operators-salt-secret"


def _hashed(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5",
                    version="0.5.8", token_delay_ms=2) as running:
        yield running


@pytest.fixture(scope="module")
def gateway(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    tenants = [{"name": "alice", "api_keys": [_hashed(KEYS["alice"])]},
               {"name": "bob", "api_keys": [_hashed(KEYS["bob"])]},
               {"name": "carol", "api_keys": [_hashed(KEYS["carol"])], "cache_group": "team"},
               {"name": "dave", "api_keys": [_hashed(KEYS["dave"])], "cache_group": "team",
                "limits": {"requests_per_min": 2}},
               {"name": "erin", "api_keys": [_hashed(KEYS["erin"])], "limits": {"output_tokens_per_min": 50}},
               {"name": "frank", "api_keys": [_hashed(KEYS["frank"])], "limits": {"output_tokens_per_min": 100}}]
    config = write_config(tmp_path_factory.mktemp("tenancy"), [model_entry("glm-5", [pair.prefill], [pair.decode])],
                          tenants=tenants, auth={"cache_salt_secret_env": "TEST_TENANCY_SALT_SECRET"})
    os.environ["TEST_TENANCY_SALT_SECRET"] = SECRET
    try:
        with running_gateway(config) as running:
            yield running
    finally:
        del os.environ["TEST_TENANCY_SALT_SECRET"]


def _send(gateway: RunningGateway, who: str | None, prompt: str, request_id: str, **extra: object) -> httpx.Response:
    headers = {"x-request-id": request_id, **({"authorization": f"Bearer {KEYS[who]}"} if who else {})}
    return httpx.post(gateway.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": "glm-5", "prompt": prompt, "max_tokens": 1, **extra})


def _engine_view(pair: EnginePair, request_id: str) -> tuple[str, str, int]:
    """(prefill's extra_key, decode's extra_key, prefill's cached tokens) for one request."""
    prefill = next(r for r in records(pair.prefill) if r["request_id"] == request_id)
    decode = next(r for r in records(pair.decode) if r["request_id"] == request_id)
    return prefill["extra_key"], decode["extra_key"], prefill["cached_tokens"]


def test_tenants_get_separate_prefix_caches_and_a_group_shares_one(gateway: RunningGateway, pair: EnginePair) -> None:
    prompt = "A confidential preamble that only its owner should ever hit in the cache. " * 40
    for n, who in enumerate(["alice", "alice", "bob", "carol", "dave"]):
        assert _send(gateway, who, prompt, f"salt-{n}").status_code == 200
    views = [_engine_view(pair, f"salt-{n}") for n in range(5)]
    assert all(prefill_key == decode_key and len(prefill_key) == 32 for prefill_key, decode_key, _ in views)
    alice, alice_again, bob, carol, dave = views
    assert alice[0] == alice_again[0] and alice_again[2] > 0  # her own repeat hits her cache
    assert bob[0] != alice[0] and bob[2] == 0  # Bob's identical prompt hits nothing of hers
    assert carol[0] not in (alice[0], bob[0]) and carol[2] == 0
    assert dave[0] == carol[0] and dave[2] > 0  # one cache group: shared on purpose


def test_a_clients_own_salt_subdivides_its_tenants_space_and_is_never_forwarded(
        gateway: RunningGateway, pair: EnginePair) -> None:
    prompt = "Another long shared prefix for the salting test. " * 40
    assert _send(gateway, "bob", prompt, "own-0").status_code == 200
    assert _send(gateway, "bob", prompt, "own-1", cache_salt="project-x").status_code == 200
    assert _send(gateway, "alice", prompt, "own-2", cache_salt="project-x").status_code == 200
    assert _send(gateway, "alice", prompt, "own-3", extra_key="project-x").status_code == 200
    plain, bob_x, alice_x, alice_extra = (_engine_view(pair, f"own-{n}") for n in range(4))
    assert len({plain[0], bob_x[0], alice_x[0]}) == 3  # the same client salt under two tenants: two spaces
    assert "project-x" not in bob_x[0] + alice_x[0]
    assert alice_extra[0] == alice_x[0]  # SGLang's two names for one thing
    assert bob_x[2] == 0 and alice_x[2] == 0


def test_without_auth_required_a_request_without_a_key_is_served_and_salted_by_its_address(
        gateway: RunningGateway, pair: EnginePair) -> None:
    assert _send(gateway, None, "hello there", "anon-0").status_code == 200
    prefill_key, decode_key, _ = _engine_view(pair, "anon-0")
    assert prefill_key == decode_key and len(prefill_key) == 32
    # A client cannot pick another address (and its salt) with X-Forwarded-For, even from loopback.
    forged = httpx.post(gateway.url + "/v1/completions", timeout=30,
                        headers={"x-request-id": "anon-xff", "x-forwarded-for": "10.9.9.9"},
                        json={"model": "glm-5", "prompt": "hello there", "max_tokens": 1})
    assert forged.status_code == 200 and _engine_view(pair, "anon-xff")[0] == prefill_key


def test_a_tenants_request_limit_answers_429_with_retry_after(gateway: RunningGateway) -> None:
    statuses = []
    for n in range(4):
        response = _send(gateway, "dave", "hi", f"limit-{n}")
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_error"
    # dave already sent one request in the cache test: one more fits his two a minute.
    assert statuses == [200, 429, 429, 429]


def test_the_salt_is_the_keyed_hash_of_the_tenants_group(gateway: RunningGateway, pair: EnginePair) -> None:
    """From the operator's secret, so every replica salts a tenant alike (and nobody without it can)."""
    assert _send(gateway, "carol", "hello", "keyed-0").status_code == 200
    expected = hmac.new(SECRET.encode(), b"\0\0\0\x04team", hashlib.sha256).hexdigest()[:32]
    assert _engine_view(pair, "keyed-0")[0] == expected


def test_output_tokens_are_charged_and_a_tenant_in_debt_waits(gateway: RunningGateway) -> None:
    first = httpx.post(gateway.url + "/v1/completions", headers={"authorization": f"Bearer {KEYS['erin']}"},
                       json={"model": "glm-5", "prompt": "count", "max_tokens": 80, "ignore_eos": True}, timeout=30)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 80

    def refused() -> bool:
        response = _send(gateway, "erin", "again", "erin-next")
        return response.status_code == 429 and "output tokens" in response.json()["error"]["message"]

    assert wait_for(refused, timeout_s=3)  # 80 produced against 50 a minute: in debt for ~36 s


def test_output_tokens_are_charged_while_a_request_streams(gateway: RunningGateway) -> None:
    """A long stream spends its tenant's output budget as it goes: the tenant's next request is refused while the
    stream is still running, not only once it ends."""
    body = {"model": "glm-5", "prompt": "go on", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEYS['frank']}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events = 0
        for line in lines:
            events += line.startswith("data: ")
            if events >= 300:
                break
        refused = _send(gateway, "frank", "meanwhile", "frank-1")
        assert refused.status_code == 429 and "output tokens" in refused.json()["error"]["message"]
        assert next(lines, None) is not None  # the stream itself was still going


def test_a_reload_revokes_a_key_and_applies_new_limits(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "reload-admin")
    tenants = [{"name": "grace", "api_keys": [_hashed("sk-grace")]}, {"name": "heidi", "api_keys": [_hashed("sk-heidi")]}]
    config = write_config(tmp_path_factory.mktemp("reload"), [model_entry("glm-5", [pair.prefill], [pair.decode])],
                          tenants=tenants, auth={"required": True})
    with running_gateway(config) as gateway:
        def ask(key: str) -> int:
            return httpx.post(gateway.url + "/generate", headers={"authorization": f"Bearer {key}"}, timeout=30,
                              json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code

        assert ask("sk-grace") == 200 and ask("sk-heidi") == 200
        document = yaml.safe_load(config.read_text())
        document["tenants"] = [{"name": "heidi", "api_keys": [_hashed("sk-heidi")],
                                "limits": {"requests_per_min": 1}}]  # grace's key revoked, heidi limited
        config.write_text(yaml.safe_dump(document))
        reloaded = httpx.post(gateway.url + "/admin/reload", headers={"authorization": "Bearer reload-admin"},
                              timeout=30)
        assert reloaded.status_code == 200, reloaded.text
        assert ask("sk-grace") == 401
        assert [ask("sk-heidi") for _ in range(2)] == [200, 429]
