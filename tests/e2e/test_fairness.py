"""No tenant can hurt another at the edge: a tenant flooding the admission of large bodies waits and is refused by
itself, while another tenant's large requests are answered as usual."""

from __future__ import annotations

import hashlib
import itertools
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=25)

KEYS = {"lister": "sk-lister", "patient": "sk-patient", "flooder": "sk-flooder", "metered": "sk-metered", "counted": "sk-counted",
        "bulky": "sk-bulky", "spender": "sk-spender"}
LIMITS = {"lister": {"requests_per_min": 2}, "metered": {"requests_per_min": 3}, "counted": {"requests_per_min": 2},
          "bulky": {"body_bytes_per_min": 1_000_000}, "spender": {"body_bytes_per_min": 1_000_000}}


def _hashed(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5",
                    version="0.5.23") as running:
        yield running


@pytest.fixture(scope="module")
def gateway(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    tenants = [{"name": name, "api_keys": [_hashed(key)], "limits": LIMITS.get(name, {})} for name, key in KEYS.items()]
    config = write_config(tmp_path_factory.mktemp("fairness"), [model_entry("glm-5", [pair.prefill], [pair.decode])],
                          tenants=tenants, auth={"required": True})
    with running_gateway(config) as running:
        yield running


def _headers(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}", "content-type": "application/json"}


def test_a_tenant_flooding_large_body_admission_does_not_delay_another_tenants_large_requests(
        gateway: RunningGateway, tmp_path: Path) -> None:
    # 16 MiB that parses as JSON but is no chat (400 in the admission worker, after a parse that takes a while).
    junk = b'{"model": "glm-5", "messages": [' + b"1," * (8 << 20) + b'1]}'
    padded = {"model": "glm-5", "prompt": "hello" + " " * 100_000, "max_tokens": 2}  # > 64 KiB: a worker's job
    stop = threading.Event()
    flooder: Counter[int] = Counter()
    # Both worker processes started first, one body of each tenant at once (each worker loads the tokenizer on its
    # first body: seconds, once).
    warm = [threading.Thread(target=lambda t=tenant: httpx.post(gateway.url + "/v1/completions", json=padded,
                                                                 timeout=60, headers=_headers(t)))
            for tenant in ("patient", "flooder")]
    for thread in warm:
        thread.start()
    for thread in warm:
        thread.join()

    def flood() -> None:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            while not stop.is_set():
                flooder[client.post("/v1/chat/completions", content=junk, headers=_headers("flooder")).status_code] += 1

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2.0)  # the flood is under way: the workers and the flooder's line are full
        latencies, statuses = [], Counter[int]()
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            for _ in range(25):
                started = time.monotonic()
                response = client.post("/v1/completions", json=padded, headers=_headers("patient"))
                latencies.append(time.monotonic() - started)
                statuses[response.status_code] += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert statuses == {200: 25}, statuses
    latencies.sort()
    assert latencies[-1] <= 1.0, f"p99 {latencies[-1]:.2f}s (median {latencies[len(latencies) // 2]:.2f}s)"
    assert flooder[429] > 0 and set(flooder) <= {400, 429}, flooder  # the flooder is refused, by itself


def test_idle_connections_from_one_address_leave_the_others_served(gateway: RunningGateway) -> None:
    host, port = gateway.url.removeprefix("http://").split(":")
    hostile: list[socket.socket] = []
    try:
        for _ in range(1030):  # more than max_connections (1024), from one address, never sending a byte
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.connect((host, int(port)))
            hostile.append(sock)
        hostile[-1].settimeout(5)
        assert hostile[-1].recv(4096).startswith(b"HTTP/1.1 503")  # beyond its share: answered at once, closed
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            for _ in range(20):
                response = client.post("/v1/completions", headers=_headers("patient"),
                                       json={"model": "glm-5", "prompt": "hello", "max_tokens": 2})
                assert response.status_code == 200, response.text
    finally:
        for sock in hostile:
            sock.close()


def test_one_api_key_holds_at_most_its_share_of_connections_from_any_number_of_addresses(
        gateway: RunningGateway) -> None:
    host, port = gateway.url.removeprefix("http://").split(":")
    # One key however it is spelled (the scheme's case, spaces), each head with a body that never comes.
    spellings = [b"Bearer ", b"bearer ", b"BEARER   "]
    heads = [b"POST /v1/completions HTTP/1.1\r\nhost: kvgate\r\nauthorization: " + scheme + KEYS["flooder"].encode()
             + b"\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n" for scheme in spellings]
    held: list[socket.socket] = []
    try:
        for n in range(257):  # the share is a quarter of max_connections (1024): 256
            sock = socket.socket()
            sock.bind(("127.0.0.3" if n % 2 else "127.0.0.4", 0))  # neither address reaches its own share
            sock.connect((host, int(port)))
            sock.sendall(heads[n % len(heads)])
            held.append(sock)
        held[-1].settimeout(5)
        answer = held[-1].recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        response = httpx.post(gateway.url + "/v1/completions", headers=_headers("patient"), timeout=30,
                              json={"model": "glm-5", "prompt": "hello", "max_tokens": 2})
        assert response.status_code == 200  # another key is served
    finally:
        for sock in held:
            sock.close()


def test_refused_requests_and_tokenize_calls_are_charged_to_their_tenant(gateway: RunningGateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for body in (b"{not json", b'{"model": "glm-5"}', b'{"model": "nope", "prompt": "x"}'):  # 400, 400, 404
            assert client.post("/v1/completions", content=body, headers=_headers("metered")).status_code in (400, 404)
        limited = client.post("/v1/completions", headers=_headers("metered"),
                              json={"model": "glm-5", "prompt": "hello", "max_tokens": 2})
        assert limited.status_code == 429 and "requests per minute" in limited.json()["error"]["message"]
        for _ in range(2):
            assert client.post("/v1/tokenize", headers=_headers("counted"),
                               json={"model": "glm-5", "prompt": "hello"}).status_code == 200
        assert client.post("/v1/completions", headers=_headers("counted"),
                           json={"model": "glm-5", "prompt": "hello", "max_tokens": 2}).status_code == 429
        assert client.get("/v1/models", headers=_headers("counted")).status_code == 429  # throttled there too


def test_a_bodys_bytes_are_charged_before_it_is_parsed(gateway: RunningGateway) -> None:
    junk = b'{"model": "glm-5", "prompt": ' + b"[" * 900_000  # never valid: its size is what costs
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert client.post("/v1/completions", content=junk, headers=_headers("bulky")).status_code == 400
        assert client.post("/v1/completions", content=junk, headers=_headers("bulky")).status_code == 400  # debt
        limited = client.post("/v1/completions", headers=_headers("bulky"),
                              json={"model": "glm-5", "prompt": "hello", "max_tokens": 2})
        assert limited.status_code == 429 and "body bytes per minute" in limited.json()["error"]["message"]
        assert int(limited.headers["retry-after"]) >= 1


def test_a_body_refused_for_an_empty_budget_is_charged_all_the_same(gateway: RunningGateway) -> None:
    junk = b'{"model": "glm-5", "prompt": ' + b"[" * 900_000
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for _ in range(2):  # 900 KB each: the budget of 1 MB a minute is 800 KB in debt
            assert client.post("/v1/completions", content=junk, headers=_headers("spender")).status_code == 400
        # Its head came before the refusal was known, so its body was read: refused, and charged.
        with httpx.Client(base_url=gateway.url, timeout=30) as other:
            refused = other.post("/v1/completions", content=junk, headers=_headers("spender"))
        assert refused.status_code == 429
        after = client.post("/v1/completions", headers=_headers("spender"),
                            json={"model": "glm-5", "prompt": "hello", "max_tokens": 2})
        # 1.7 MB in debt now (0.8 MB had it not been charged): over a minute and a half to pay off.
        assert after.status_code == 429 and int(after.headers["retry-after"]) > 90


def test_listing_the_models_costs_a_request_too(gateway: RunningGateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert [client.get("/v1/models", headers=_headers("lister")).status_code for _ in range(2)] == [200, 200]
        assert client.get("/v1/models/glm-5", headers=_headers("lister")).status_code == 429
        assert client.post("/v1/completions", headers=_headers("lister"),
                           json={"model": "glm-5", "prompt": "hello", "max_tokens": 2}).status_code == 429


@pytest.fixture(scope="module")
def open_gateway(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    """Keys not required: a client no tenant claims is served as its own (throwaway) tenant."""
    tenants = [{"name": "patient", "api_keys": [_hashed(KEYS["patient"])]}]
    config = write_config(tmp_path_factory.mktemp("open"), [model_entry("glm-5", [pair.prefill], [pair.decode])],
                          tenants=tenants)
    with running_gateway(config) as running:
        yield running


def test_throwaway_keys_share_one_line_and_cannot_crowd_out_a_configured_tenant(open_gateway: RunningGateway) -> None:
    junk = b'{"model": "glm-5", "messages": [' + b"1," * (8 << 20) + b'1]}'
    padded = {"model": "glm-5", "prompt": "hello" + " " * 100_000, "max_tokens": 2}
    stop = threading.Event()
    flooder: Counter[int] = Counter()

    def flood(thread: int) -> None:
        with httpx.Client(base_url=open_gateway.url, timeout=60) as client:
            for n in itertools.count():
                if stop.is_set():
                    return
                key = {"authorization": f"Bearer junk-{thread}-{n}", "content-type": "application/json"}
                flooder[client.post("/v1/chat/completions", content=junk, headers=key).status_code] += 1

    warm = [threading.Thread(target=lambda h=h: httpx.post(open_gateway.url + "/v1/completions", json=padded,
                                                            timeout=60, headers=h))
            for h in (_headers("patient"), {"authorization": "Bearer warm-up"})]
    for thread in warm:
        thread.start()
    for thread in warm:
        thread.join()
    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(12)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2.0)
        latencies, statuses = [], Counter[int]()
        with httpx.Client(base_url=open_gateway.url, timeout=60) as client:
            for _ in range(15):
                started = time.monotonic()
                statuses[client.post("/v1/completions", json=padded, headers=_headers("patient")).status_code] += 1
                latencies.append(time.monotonic() - started)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert statuses == {200: 15}, statuses
    assert max(latencies) <= 1.0, sorted(latencies)
    assert flooder[429] > 0 and set(flooder) <= {400, 429}, flooder
