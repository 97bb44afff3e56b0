"""An operator's abort by request id also reaches a request still waiting in the pool's queue: it is refused when its
turn comes (503 `aborted_by_operator`) and never reaches an engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from loadtests.engine.harness import start_pair
from tests.engine_records import records, wait_for
from tests.gateway_harness import model_entry, running_gateway, write_config


def test_a_queued_request_aborted_by_id_is_refused_and_never_reaches_an_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "queue-admin")
    admin = {"authorization": "Bearer queue-admin"}
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                    token_delay_ms=10) as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode],
                                                     limits={"max_inflight_per_worker": 1})])
        with running_gateway(config) as gateway:
            body = {"model": "glm-5", "messages": [{"role": "user", "content": "hold the only slot"}],
                    "max_tokens": 150, "ignore_eos": True, "stream": True}
            answers: dict[str, httpx.Response] = {}

            def queued() -> None:
                answers["queued"] = httpx.post(gateway.url + "/v1/chat/completions", timeout=30,
                                               headers={"x-request-id": "team-a/queued-1"},
                                               json={**body, "stream": False, "max_tokens": 2})

            with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=30) as holder:
                lines = holder.iter_lines()
                next(lines)  # the only slot is taken
                waiter = threading.Thread(target=queued)
                waiter.start()
                time.sleep(0.3)  # admitted and waiting in the queue
                aborted = httpx.post(gateway.url + "/admin/requests/team-a/queued-1/abort", headers=admin,  # a "/" too
                                     timeout=10)
                assert aborted.status_code == 200 and aborted.json()["aborted_here"] == 1
                for _ in lines:  # the holder finishes; the queued request's turn comes
                    pass
            waiter.join(timeout=20)
            refused = answers["queued"]
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "aborted_by_operator"
            assert wait_for(lambda: records(pair.decode), timeout_s=2)
            assert not [r for e in (pair.prefill, pair.decode) for r in records(e)
                        if r["request_id"] == "team-a/queued-1"]


def test_a_request_aborted_by_id_while_its_large_body_is_counted_is_refused_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "queue-admin")
    admin = {"authorization": "Bearer queue-admin"}
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5",
                    version="0.5.23") as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode])])
        with running_gateway(config) as gateway:
            answers: dict[str, httpx.Response] = {}

            def large() -> None:  # over 64 KiB: counted in an admission worker, which starts on first use (seconds)
                answers["large"] = httpx.post(gateway.url + "/v1/completions", timeout=60,
                                              headers={"x-request-id": "team-a/large-1"},
                                              json={"model": "glm-5", "prompt": "hi" + " " * 100_000, "max_tokens": 2})

            sender = threading.Thread(target=large)
            sender.start()
            time.sleep(0.5)  # its body is in, being counted
            aborted = httpx.post(gateway.url + "/admin/requests/team-a/large-1/abort", headers=admin, timeout=10)
            assert aborted.status_code == 200 and aborted.json()["aborted_here"] == 1
            sender.join(timeout=60)
            refused = answers["large"]
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "aborted_by_operator"
            assert not [r for e in (pair.prefill, pair.decode) for r in records(e)
                        if r["request_id"] == "team-a/large-1"]
