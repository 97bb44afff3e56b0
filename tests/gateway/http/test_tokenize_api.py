"""`/v1/tokenize` and `/v1/detokenize` are served like the generate routes up to the engine: the API key and tenant
throttling before the body is read, the body limit and timeout, and a large body handled in an admission worker
process, so no body, however built, holds the event loop. `/v1/models` too needs the key where one is required."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from loadtests.engine.harness import EnginePair
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

KEY = "sk-tokenize-test"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def gateway(glm_pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    tenants = [{"name": "alice", "api_keys": ["sha256:" + hashlib.sha256(KEY.encode()).hexdigest()]}]
    config = write_config(tmp_path_factory.mktemp("tokenize"), [model_entry("glm-5", [glm_pair.prefill],
                                                                            [glm_pair.decode])],
                          tenants=tenants, auth={"required": True}, max_body_bytes=8 * 2**20,
                          timeouts={"client_body_s": 1.0})
    with running_gateway(config) as running:
        yield running


@pytest.mark.parametrize(("path", "body"), [("/v1/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [1]}),
                                            ("/tokenize", {"prompt": "hi"})])
def test_a_key_is_needed_as_on_the_generate_routes(gateway: RunningGateway, path: str, body: dict) -> None:
    refused = httpx.post(gateway.url + path, json=body, timeout=10)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert httpx.post(gateway.url + path, json=body, headers=AUTH, timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/glm-5", "/v1/models/unknown"])
def test_the_models_and_their_limits_are_for_clients_with_a_key(gateway: RunningGateway, path: str) -> None:
    refused = httpx.get(gateway.url + path, timeout=10)
    assert refused.status_code == 401 and "glm-5" not in refused.text
    assert httpx.get(gateway.url + path, headers=AUTH, timeout=10).status_code == (404 if "unknown" in path else 200)


def test_a_body_over_the_limit_is_refused_before_it_is_read(gateway: RunningGateway) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/tokenize HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
                     + b"\r\ncontent-type: application/json\r\ncontent-length: 999999999999\r\n\r\n{")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413") and b"body_too_large" in answer


def test_a_body_that_never_finishes_is_timed_out(gateway: RunningGateway) -> None:
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/tokenize HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
                     + b"\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\": ")
        started = time.monotonic()
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 5


def test_large_bodies_are_answered_off_the_loop_and_count_as_small_ones_do(gateway: RunningGateway) -> None:
    text = "Count me exactly, as admission would. " * 4000  # ~150 KB: the admission worker's
    small = httpx.post(gateway.url + "/v1/tokenize", json={"prompt": text[:2000]}, headers=AUTH, timeout=30).json()
    large = httpx.post(gateway.url + "/v1/tokenize", json={"prompt": text}, headers=AUTH, timeout=60).json()
    assert large["count"] > 30_000 and large["tokens"][:100] == small["tokens"][:100]
    back = httpx.post(gateway.url + "/v1/detokenize", json={"tokens": large["tokens"]}, headers=AUTH, timeout=60)
    assert back.status_code == 200 and back.json()["text"].startswith("Count me exactly")
    # A body built to be slow to parse (6 MB of nested arrays) while /healthz is asked every 5 ms.
    junk = b'{"prompt": "hi", "junk": [' + b"[[],[]]," * 750_000 + b"[]]}"
    worst: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=gateway.url, timeout=10) as client:
            while not stop.is_set():
                started = time.monotonic()
                client.get("/healthz")
                worst.append(time.monotonic() - started)
                time.sleep(0.005)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        answer = httpx.post(gateway.url + "/v1/tokenize", content=junk, timeout=60,
                            headers={**AUTH, "content-type": "application/json"})
    finally:
        stop.set()
        prober.join()
    assert answer.status_code == 200 and answer.json()["count"] > 0
    assert max(worst) < 0.5, max(worst)  # parsed in 1–2 s in-process before: the loop stalled that long
