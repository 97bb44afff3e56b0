"""Metrics per promise: after a scripted mix of requests (ok, over the limit, a client gone mid-request, a prefill
failure) the scraped /metrics shows the exact count of each, and promtool accepts the exposition."""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import LoggingConfig
from gateway.telemetry.logs import JsonLines, configure_logging
from loadtests.engine.harness import EnginePair
from tests.engine_records import inject, reset, wait_for
from tests.gateway_harness import access_log_lines, model_entry, running_gateway, write_config

CHAT = {"model": "glm-5", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
LONG = {**CHAT, "messages": [{"role": "user", "content": "word " * 400}]}


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _leave_early(port: int) -> None:
    """A client that sends its request and goes away before any answer."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.2)


def test_a_scripted_mix_shows_exact_counts(glm_pair: EnginePair, tmp_path: Path) -> None:
    reset(glm_pair.prefill, glm_pair.decode)
    config = write_config(tmp_path, [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode],
                                                 max_prompt_tokens=200)])
    with running_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert [client.post("/v1/chat/completions", json=CHAT).status_code for _ in range(3)] == [200] * 3
        assert [client.post("/v1/chat/completions", json=LONG).status_code for _ in range(2)] == [413] * 2
        inject(glm_pair.decode, action="slow_first_token", delay_ms=600, count=1, rid_prefix="kvg-")
        _leave_early(int(gateway.url.rsplit(":", 1)[1]))
        inject(glm_pair.prefill, action="fail", status=500, count=1, rid_prefix="kvg-")
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 502

        def scraped() -> str:
            return client.get("/metrics").text

        # Exchanges are observed when both halves are closed and every abort answered, which may be after the
        # client's answer (the one whose client left: ~0.6 s on).
        def observed(outcome: str) -> float:
            return sample(scraped(), "kvgate_request_duration_seconds_count", model="glm-5", outcome=outcome)

        assert wait_for(lambda: observed("client_gone") == 1 and observed("prefill_failed") == 1
                        and observed("ok") == 3, timeout_s=10)
        text = scraped()
        route = "/v1/chat/completions"
        assert sample(text, "kvgate_requests_total", model="glm-5", route=route, status="200") == 3
        assert sample(text, "kvgate_requests_total", model="glm-5", route=route, status="413") == 2
        assert sample(text, "kvgate_requests_total", model="glm-5", route=route, status="502") == 1
        assert sample(text, "kvgate_requests_total", model="glm-5", route=route, status="499") == 1
        assert sample(text, "kvgate_admission_rejections_total", model="glm-5", reason="over_limit") == 2
        assert sample(text, "kvgate_cancellations_total", model="glm-5", cause="prefill_failed") == 1
        assert sample(text, "kvgate_cancellations_total", model="glm-5", cause="client_gone") == 1
        assert sample(text, "kvgate_held_after_disconnect_total", model="glm-5") == 1
        assert sample(text, "kvgate_request_duration_seconds_count", model="glm-5", outcome="ok") == 3
        assert sample(text, "kvgate_prompt_tokens_count", model="glm-5") == 5  # every dispatched request
        # Streams only (the one whose client left after its first token): a whole answer shows no first token.
        assert sample(text, "kvgate_time_to_first_token_seconds_count", model="glm-5") == 1
        assert sample(text, "kvgate_aborts_total", role="decode", acknowledged="true") == 2
        assert sample(text, "kvgate_prompt_limit_ratio_bucket", model="glm-5", le="1.0") == 5
        assert sample(text, "kvgate_worker_in_flight", model="glm-5", role="decode") == 0
        assert sample(text, "kvgate_worker_breaker_state", model="glm-5", role="prefill", state="closed") == 1
        assert sample(text, "kvgate_gate_verdict", model="glm-5", verdict="pass") == 1
        assert sample(text, "kvgate_event_loop_lag_seconds_count") >= 1
        if shutil.which("promtool") is None:
            pytest.skip("promtool not installed (Debian package prometheus): exposition format not checked")
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_access_log_is_one_json_line_per_request_without_prompt_text(glm_pair: EnginePair, tmp_path: Path) -> None:
    secret = "the launch code is swordfish " * 60
    config = write_config(tmp_path, [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode],
                                                 max_prompt_tokens=200)])
    with access_log_lines() as lines, running_gateway(config) as gateway, \
            httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        too_long = {**CHAT, "messages": [{"role": "user", "content": secret}]}
        assert client.post("/v1/chat/completions", json=too_long).status_code == 413
    entries = [json.loads(line) for line in lines]
    assert [(e["status"], e["model"]) for e in entries] == [(200, "glm-5"), (413, "glm-5")]
    ok, refused = entries
    assert ok["outcome"] == "ok" and ok["prompt_tokens"] > 0 and ok["decode"] == glm_pair.decode.url
    assert len(ok["request_id"]) == 32 and "ttft_ms" not in ok  # a whole answer shows no first token
    assert refused["error_code"] == "context_length_exceeded" and "swordfish" not in lines[1]


def test_access_log_false_silences_the_access_log() -> None:
    root, level = logging.getLogger(), logging.getLogger().level
    try:
        for enabled in (False, True):
            document = yaml.safe_load(f"logging: {{format: json, access_log: {str(enabled).lower()}}}")
            handler = configure_logging("info", LoggingConfig.model_validate(document["logging"]))
            assert logging.getLogger("kvgate.access").disabled is (not enabled)
            assert isinstance(handler.formatter, JsonLines) and handler in root.handlers
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
