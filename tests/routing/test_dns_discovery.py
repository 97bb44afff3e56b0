"""Workers from DNS, against a real DNS server on loopback (dnslib, UDP): a name that gains an address sends it
traffic only once the KV-pool gate passed it; one that loses an address drains it; a failed lookup changes nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dnslib import QTYPE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSServer

from loadtests.engine.harness import RunningEngine, free_port, start_engine, start_pair
from tests.engine_records import generation_records, reset, wait_for
from tests.gateway_harness import model_entry, running_gateway, write_config

NAME = "decode.kvgate.test"
CHAT = {"model": "glm-5", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


class Zone(BaseResolver):  # type: ignore[misc]
    """A records for NAME, changed by the test; `failing` makes the server answer SERVFAIL."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.failing = False
        self.lock = threading.Lock()

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        with self.lock:
            if self.failing:
                reply.header.rcode = 2  # SERVFAIL
                return reply
            if str(request.q.qname).rstrip(".") == NAME and request.q.qtype == QTYPE.A:
                for address in self.addresses:
                    reply.add_answer(RR(NAME, QTYPE.A, rdata=A(address), ttl=0))
            elif str(request.q.qname).rstrip(".") != NAME:
                reply.header.rcode = 3  # NXDOMAIN
        return reply


@pytest.fixture
def zone() -> Iterator[tuple[Zone, int]]:
    records = Zone()
    port = free_port()
    server = DNSServer(records, port=port, address="127.0.0.1")
    server.start_thread()
    yield records, port
    server.stop()


def test_dns_workers_join_through_the_gate_and_leave_by_draining(zone: tuple[Zone, int], tmp_path: Path) -> None:
    records, dns_port = zone
    port = free_port("127.0.0.2")
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5",
                    version="0.5.23") as pair:
        decodes: list[RunningEngine] = []
        try:
            for host, pool in (("127.0.0.2", 20000), ("127.0.0.3", 20000), ("127.0.0.4", 2000)):
                decodes.append(start_engine("decode", pool_tokens=pool, context_length=8192, model="glm-5",
                                            version="0.5.23", host=host, port=port,
                                            bootstrap_port=pair.prefill.bootstrap_port))
            first, second, small = decodes
            records.addresses = ["127.0.0.2"]
            entry = model_entry("glm-5", [pair.prefill], [], routing={"decode_policy": "least_outstanding"})
            entry["decode"] = [{"dns": f"{NAME}:{port}", "interval_s": 0.2}]
            config = write_config(tmp_path, [entry], health={"interval_s": 60},
                                  discovery={"nameservers": [f"127.0.0.1:{dns_port}"]})
            with running_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
                pool = gateway.gateway.models["glm-5"].pool
                assert [w.url for w in pool.decode] == [first.url]  # resolved before the startup gate
                assert client.post("/v1/chat/completions", json=CHAT).status_code == 200

                records.addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
                assert wait_for(lambda: second.url in {w.url for w in pool.decode if w.usable}, timeout_s=5)
                reset(*decodes)
                for _ in range(6):
                    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
                assert generation_records(second) and generation_records(first)
                assert not generation_records(small)  # its pool of 2000 fails the gate: never in the pool
                assert small.url not in {w.url for w in pool.decode}

                records.failing = True  # a resolver failure keeps the workers as they are
                gateway_sees = len(pool.decode)
                threading.Event().wait(0.6)
                assert len(pool.decode) == gateway_sees == 2
                records.failing = False

                records.addresses = ["127.0.0.3"]
                assert wait_for(lambda: [w.url for w in pool.decode] == [second.url], timeout_s=5)
                reset(*decodes)
                for _ in range(3):
                    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
                assert not generation_records(first) and len(generation_records(second)) == 3
        finally:
            for engine in decodes:
                engine.stop()
