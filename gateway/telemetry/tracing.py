"""OpenTelemetry traces (off by default): one span per client request, with children for admission, routing, the
prefill and the decode half (first token as an event), attributes after the GenAI semantic conventions plus
kvgate's own. The client's W3C `traceparent` is the parent; both engine requests carry the request span's.

Each gateway has its own TracerProvider (never the process-global one), so several can live in one process and a
test can read spans from an in-memory exporter. The exchange's halves are recorded when they end, from the times
the lifecycle noted (monotonic clock, converted to wall time here). Prompt text is never recorded."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.config import TracingConfig
from gateway.telemetry.record import RequestRecord

if TYPE_CHECKING:
    from gateway.pd.exchange import PDExchange

_PROPAGATOR = TraceContextTextMapPropagator()
# W3C Trace Context: version ff is invalid, and so are an all-zero trace id or parent id.
_TRACEPARENT = re.compile(r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/generate": "generate"}
# monotonic seconds → Unix nanoseconds (the lifecycle notes times on the monotonic clock)
_WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def _wall_ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _WALL_OFFSET_NS


def client_traceparent(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The client's traceparent when it is well formed (anything else is ignored, never forwarded)."""
    for name, value in headers:
        if name == b"traceparent":
            text = value.decode("latin-1").strip().lower()
            return text if _TRACEPARENT.match(text) else None
    return None


class Tracing:
    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        """`exporter`: where spans go (default: OTLP/HTTP to `config.otlp_endpoint`, or nowhere)."""
        self.enabled = config.enabled
        self._provider: TracerProvider | None = None
        if not config.enabled:
            return
        provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}),
                                  sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        if exporter is None and config.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        self._provider = provider
        self._tracer = provider.get_tracer("kvgate")

    def start_request(self, record: RequestRecord, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """The request's span, child of the client's traceparent; its traceparent goes to both engines."""
        parent_header = client_traceparent(headers)
        if self._provider is None:
            record.engine_traceparent = parent_header  # not tracing: the client's own context passes through
            return
        parent = _PROPAGATOR.extract({"traceparent": parent_header}) if parent_header else None
        span = self._tracer.start_span(f"{_OPERATIONS.get(record.route, 'generate')}", context=parent,
                                       kind=SpanKind.SERVER, start_time=_wall_ns(record.started_at),
                                       attributes={"gen_ai.operation.name": _OPERATIONS.get(record.route, ""),
                                                   "http.route": record.route, "kvgate.request_id": record.request_id})
        record.span = span
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        record.engine_traceparent = carrier.get("traceparent")
        context = span.get_span_context()
        record.trace_id = format(context.trace_id, "032x") if context.is_valid else None

    def end_request(self, record: RequestRecord, *, effective_limit: int | None) -> None:
        """When the client's answer is done and, if one ran, the exchange has closed."""
        span = record.span
        if span is None:
            return
        context = trace.set_span_in_context(span)
        if record.model:
            span.set_attribute("gen_ai.request.model", record.model)
            span.update_name(f"{_OPERATIONS.get(record.route, 'generate')} {record.model}")
        span.set_attribute("http.response.status_code", record.status or 499)
        if effective_limit is not None:
            span.set_attribute("kvgate.limit.effective", effective_limit)
        if record.admission_s is not None:
            self._child("kvgate.admit", context, record.started_at, record.started_at + record.admission_s)
        exchange = record.exchange
        if exchange is not None:
            if record.queue_s is not None:
                self._child("kvgate.route", context, exchange.started_at - record.queue_s, exchange.started_at)
            self._exchange_spans(span, context, exchange)
        if record.refused is not None:
            span.set_attribute("kvgate.outcome", record.refused.code or f"http_{record.refused.status}")
        if (record.status or 499) >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=_wall_ns(max(time.monotonic(), exchange.finished_at or 0) if exchange else time.monotonic()))

    def _exchange_spans(self, span: Span, context: object, exchange: PDExchange) -> None:
        admitted = exchange.admitted
        span.set_attributes({
            "gen_ai.usage.input_tokens": exchange.prompt_tokens, "gen_ai.usage.output_tokens": exchange.output_events,
            "gen_ai.request.max_tokens": admitted.max_new_tokens, "kvgate.rid": exchange.rid,
            "kvgate.prefill.worker": exchange.pair.prefill.url, "kvgate.decode.worker": exchange.pair.decode.url,
            "kvgate.outcome": exchange.outcome, "kvgate.retries": exchange.retries_made})
        end = exchange.finished_at or time.monotonic()
        self._child("kvgate.prefill", context, exchange.started_at, exchange.prefill_settled_at or end,
                    {"kvgate.worker": exchange.pair.prefill.url})
        decode = self._tracer.start_span("kvgate.decode", context=context, kind=SpanKind.CLIENT,  # type: ignore[arg-type]
                                         start_time=_wall_ns(exchange.started_at),
                                         attributes={"kvgate.worker": exchange.pair.decode.url})
        if exchange.first_token_at is not None:
            decode.add_event("first_token", timestamp=_wall_ns(exchange.first_token_at))
        decode.end(end_time=_wall_ns(exchange.decode_closed_at or end))

    def _child(self, name: str, context: object, start: float, end: float,
               attributes: dict[str, str] | None = None) -> None:
        child = self._tracer.start_span(name, context=context, start_time=_wall_ns(start),  # type: ignore[arg-type]
                                        attributes=attributes)
        child.end(end_time=_wall_ns(end))

    def flush(self) -> None:
        if self._provider is not None:
            self._provider.force_flush()

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # flushes what the batch processor holds
