"""The admin API and reloads: workers join only through the KV-pool gate, drain and removal let streams in flight
finish, a reload applies new workers and limits for new requests without dropping a stream, and a bad reload keeps
the running configuration."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtests.engine.harness import start_engine
from tests.engine_records import generation_records, reset, wait_for
from tests.gateway_harness import Trio, model_entry, running_gateway, start_trio, write_config

TOKEN = "s3cret-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "glm-5", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def trio() -> Iterator[Trio]:
    with start_trio(token_delay_ms=20) as engines:
        yield engines


@pytest.fixture
def admin_token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("KVGATE_TEST_ADMIN_TOKEN", TOKEN)
    return TOKEN


def one_decode_gateway(trio: Trio, directory: Path, **model: Any) -> tuple[Path, Any]:
    config = write_config(directory, [model_entry("glm-5", [trio.prefill], [trio.decodes[0]], **model)],
                          health={"interval_s": 60}, admin={"token_env": "KVGATE_TEST_ADMIN_TOKEN"})
    return config, running_gateway(config)


def stream_in_background(url: str, tokens: int) -> tuple[threading.Thread, list[bytes]]:
    body: list[bytes] = []

    def run() -> None:
        request = {"text": "Count slowly.", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
                   "stream": True}
        with httpx.stream("POST", url + "/generate", json=request, timeout=60) as response:
            body.append(b"".join(response.iter_bytes()))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, body


def test_the_admin_api_needs_its_token_and_every_answer_has_a_request_id(trio: Trio, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, gateway_cm = one_decode_gateway(trio, tmp_path)
    with gateway_cm as gateway:
        monkeypatch.delenv("KVGATE_TEST_ADMIN_TOKEN", raising=False)
        off = httpx.get(gateway.url + "/admin/workers", headers=AUTH)
        assert off.status_code == 403 and off.headers["x-request-id"]
        monkeypatch.setenv("KVGATE_TEST_ADMIN_TOKEN", TOKEN)
        wrong = httpx.get(gateway.url + "/admin/workers", headers={"authorization": "Bearer guess"})
        assert wrong.status_code == 401 and wrong.headers["x-request-id"]
        listed = httpx.get(gateway.url + "/admin/workers", headers=AUTH)
        assert listed.status_code == 200 and listed.headers["x-request-id"] != wrong.headers["x-request-id"]
        workers = listed.json()["workers"]
        assert {(w["role"], w["url"], w["in_rotation"], w["breaker"]) for w in workers} == {
            ("prefill", trio.prefill.url, True, "closed"), ("decode", trio.decodes[0].url, True, "closed")}
        assert all(w["gate"]["pool_tokens"] == 20000 for w in workers)


def test_a_worker_added_through_the_api_takes_traffic_only_after_the_gate_passed_it(
        trio: Trio, tmp_path: Path, admin_token: str) -> None:
    small = start_engine("decode", pool_tokens=2000, context_length=8192, model="glm-5", version="0.5.23",
                         bootstrap_port=trio.prefill.bootstrap_port)
    try:
        _, gateway_cm = one_decode_gateway(trio, tmp_path, routing={"decode_policy": "least_outstanding"})
        with gateway_cm as gateway:
            refused = httpx.post(gateway.url + "/admin/workers", headers=AUTH, timeout=30,
                                 json={"model": "glm-5", "role": "decode", "url": small.url})
            assert refused.status_code == 422 and "KV pool of 2000 tokens" in refused.json()["error"]["message"]
            listed = httpx.get(gateway.url + "/admin/workers", headers=AUTH).json()["workers"]
            assert small.url not in {w["url"] for w in listed}  # not kept
            added = httpx.post(gateway.url + "/admin/workers", headers=AUTH, timeout=30,
                               json={"model": "glm-5", "role": "decode", "url": trio.decodes[1].url})
            assert added.status_code == 201 and added.json()["in_rotation"] and added.json()["origin"] == "admin"
            again = httpx.post(gateway.url + "/admin/workers", headers=AUTH, timeout=30,
                               json={"model": "glm-5", "role": "decode", "url": trio.decodes[1].url})
            assert again.status_code == 409
            bad = httpx.post(gateway.url + "/admin/workers", headers=AUTH, json={"model": "glm-5", "role": "x"})
            assert bad.status_code == 400
            reset(*trio.decodes)
            for _ in range(4):
                assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
            assert len(generation_records(trio.decodes[1])) > 0
        assert not generation_records(small)
    finally:
        small.stop()


def test_drain_and_remove_let_streams_in_flight_finish_and_send_nothing_new(trio: Trio, tmp_path: Path,
                                                                           admin_token: str) -> None:
    entry = model_entry("glm-5", [trio.prefill], trio.decodes, routing={"decode_policy": "least_outstanding"})
    config = write_config(tmp_path, [entry], health={"interval_s": 60},
                          admin={"token_env": "KVGATE_TEST_ADMIN_TOKEN"})
    with running_gateway(config) as gateway:
        reset(*trio.decodes)
        workers = {w["url"]: w for w in httpx.get(gateway.url + "/admin/workers", headers=AUTH).json()["workers"]}
        thread, body = stream_in_background(gateway.url, 60)  # ~1.2 s on one of the decodes
        assert wait_for(lambda: any(len(generation_records(d)) for d in trio.decodes), timeout_s=10)
        busy = next(d for d in trio.decodes if generation_records(d))
        idle = next(d for d in trio.decodes if d is not busy)
        drained = httpx.post(f"{gateway.url}/admin/workers/{workers[busy.url]['id']}/drain", headers=AUTH)
        assert drained.status_code == 200 and drained.json()["draining"] and drained.json()["in_flight"] == 1
        for _ in range(3):
            assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        removed = httpx.delete(f"{gateway.url}/admin/workers/{workers[busy.url]['id']}", headers=AUTH)
        assert removed.status_code == 200 and removed.json()["removed"]
        thread.join(timeout=30)
        assert body and body[0].endswith(b"data: [DONE]\n\n")  # the stream in flight finished on the drained worker
        assert len(generation_records(busy)) == 1 and len(generation_records(idle)) == 3
        listed = httpx.get(gateway.url + "/admin/workers", headers=AUTH).json()["workers"]
        assert busy.url not in {w["url"] for w in listed}
        assert httpx.delete(f"{gateway.url}/admin/workers/{workers[busy.url]['id']}", headers=AUTH).status_code == 404


def test_a_reload_adds_a_worker_and_changes_a_limit_without_dropping_a_stream(trio: Trio, tmp_path: Path,
                                                                              admin_token: str) -> None:
    config, gateway_cm = one_decode_gateway(trio, tmp_path)
    with gateway_cm as gateway:
        reset(*trio.decodes)
        thread, body = stream_in_background(gateway.url, 60)
        assert wait_for(lambda: generation_records(trio.decodes[0]), timeout_s=10)
        document = yaml.safe_load(config.read_text())
        model = document["models"][0]
        model["decode"].append({"url": trio.decodes[1].url})
        model["max_prompt_tokens"] = 40
        model["routing"] = {"decode_policy": "least_outstanding"}
        config.write_text(yaml.safe_dump(document))
        reloaded = httpx.post(gateway.url + "/admin/reload", headers=AUTH, timeout=30)
        assert reloaded.status_code == 200, reloaded.text
        assert any("added" in change for change in reloaded.json()["changes"])
        long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 60}]}
        too_long = httpx.post(gateway.url + "/v1/chat/completions", json=long_prompt, timeout=30)
        assert too_long.status_code == 413 and "maximum context length is 40" in too_long.json()["error"]["message"]
        assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        assert generation_records(trio.decodes[1])  # the stream keeps decode 0 busy: the new decode served it
        thread.join(timeout=30)
        assert body and body[0].endswith(b"data: [DONE]\n\n")


def test_a_bad_reload_is_refused_and_the_running_configuration_stays(trio: Trio, tmp_path: Path,
                                                                     admin_token: str) -> None:
    config, gateway_cm = one_decode_gateway(trio, tmp_path)
    good = config.read_text()
    with gateway_cm as gateway:
        config.write_text("models: [")
        broken = httpx.post(gateway.url + "/admin/reload", headers=AUTH, timeout=30)
        assert broken.status_code == 400 and "not valid YAML" in broken.json()["error"]["message"]
        document = yaml.safe_load(good)
        document["models"][0]["tokenizer"] = str(tmp_path / "other.json")
        (tmp_path / "other.json").write_text("{}")
        config.write_text(yaml.safe_dump(document))
        restart = httpx.post(gateway.url + "/admin/reload", headers=AUTH, timeout=30)
        assert restart.status_code == 400 and "needs a restart" in restart.json()["error"]["message"]
        assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


