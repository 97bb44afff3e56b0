"""Traces: one span per request with children for admission, routing, prefill and decode, the client's trace
context as parent and on both engine requests, GenAI attributes, no prompt text; and OTLP/HTTP export to a
receiver on loopback."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import TracingConfig, load_config
from gateway.telemetry.tracing import Tracing
from loadtests.engine.harness import EnginePair, free_port
from tests.engine_records import generation_records, reset, wait_for
from tests.gateway_harness import model_entry, running_gateway, write_config

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SECRET = "the launch code is swordfish"
CHAT = {"model": "glm-5", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 4}


def test_a_request_is_one_span_tree_under_the_clients_trace_and_engines_carry_it(glm_pair: EnginePair,
                                                                                 tmp_path: Path) -> None:
    reset(glm_pair.prefill, glm_pair.decode)
    config = write_config(tmp_path, [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode])])
    with running_gateway(config) as gateway:
        exporter = InMemorySpanExporter()
        gateway.gateway.tracing = tracing = Tracing(TracingConfig(enabled=True), exporter=exporter)
        response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30,
                              headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert response.status_code == 200

        def finished() -> int:  # the request's span ends once its exchange has closed, just after the answer
            tracing.flush()
            return len(exporter.get_finished_spans())

        assert wait_for(lambda: finished() == 5, timeout_s=5)
        spans = {span.name: span for span in exporter.get_finished_spans()}
        assert set(spans) == {"chat glm-5", "kvgate.admit", "kvgate.route", "kvgate.prefill", "kvgate.decode"}
        root = spans["chat glm-5"]
        assert all(format(s.context.trace_id, "032x") == TRACE_ID for s in spans.values())
        assert root.parent is not None and format(root.parent.span_id, "016x") == CLIENT_SPAN
        assert all(s.parent is not None and s.parent.span_id == root.context.span_id
                   for name, s in spans.items() if name != "chat glm-5")
        attributes = root.attributes or {}
        assert attributes["gen_ai.request.model"] == "glm-5" and attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.usage.input_tokens"] == int(response.headers["x-kvgate-prompt-tokens"])
        assert attributes["kvgate.outcome"] == "ok" and attributes["kvgate.decode.worker"] == glm_pair.decode.url
        assert [event.name for event in spans["kvgate.decode"].events] == ["first_token"]
        assert all(SECRET not in str(s.attributes) and SECRET not in s.name for s in spans.values())
        root_span = format(root.context.span_id, "016x")
        for engine in (glm_pair.prefill, glm_pair.decode):
            (record,) = generation_records(engine)
            assert record["traceparent"] == f"00-{TRACE_ID}-{root_span}-01"


def test_without_tracing_a_well_formed_client_context_passes_through_and_a_malformed_one_is_dropped(
        glm_pair: EnginePair, tmp_path: Path) -> None:
    reset(glm_pair.prefill, glm_pair.decode)
    config = write_config(tmp_path, [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode])])
    with running_gateway(config) as gateway:
        for header in (f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "00-not-a-trace-context; x=1",
                       f"ff-{TRACE_ID}-{CLIENT_SPAN}-01", f"00-{'0' * 32}-{CLIENT_SPAN}-01",
                       f"00-{TRACE_ID}-{'0' * 16}-01"):  # W3C: version ff, all-zero ids are invalid
            response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30,
                                  headers={"traceparent": header})
            assert response.status_code == 200
    traceparents = [r["traceparent"] for r in generation_records(glm_pair.prefill)]
    assert traceparents == [f"00-{TRACE_ID}-{CLIENT_SPAN}-01", None, None, None, None]


class _Receiver(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, bytes]]] = []  # shared by every handler instance

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self.received.append((self.path, body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    port = free_port()
    server = HTTPServer(("127.0.0.1", port), _Receiver)
    _Receiver.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1/traces", _Receiver.received
    server.shutdown()


def test_spans_are_exported_over_otlp_http(glm_pair: EnginePair, tmp_path: Path,
                                           receiver: tuple[str, list[tuple[str, bytes]]]) -> None:
    endpoint, received = receiver
    config = write_config(tmp_path, [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode])],
                          tracing={"enabled": True, "otlp_endpoint": endpoint, "service_name": "kvgate-test"})
    with running_gateway(config) as gateway:
        response = httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30,
                              headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert response.status_code == 200
    # stopping the gateway flushed the batch processor
    assert received and all(path == "/v1/traces" for path, _ in received)
    body = b"".join(payload for _, payload in received)
    assert bytes.fromhex(TRACE_ID) in body and b"kvgate-test" in body and SECRET.encode() not in body


def test_sample_ratio_zero_starts_no_trace_but_follows_a_sampled_client(glm_pair: EnginePair, tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode])],
                          tracing={"enabled": True, "sample_ratio": 0.0})
    exporter = InMemorySpanExporter()
    with running_gateway(config) as gateway:
        gateway.gateway.tracing = tracing = Tracing(load_config(config).tracing, exporter=exporter)
        assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        assert httpx.post(gateway.url + "/v1/chat/completions", json=CHAT, timeout=30,
                          headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}).status_code == 200

        def traces() -> set[str]:
            tracing.flush()
            return {format(span.context.trace_id, "032x") for span in exporter.get_finished_spans()}

        assert wait_for(lambda: traces() == {TRACE_ID}, timeout_s=5)  # only the client's sampled trace
