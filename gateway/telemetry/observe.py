"""Turning what happened to a request into metrics and its access-log line (traces: gateway.telemetry.tracing)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gateway.telemetry.metrics import GatewayMetrics, rejection_reason
from gateway.telemetry.record import RequestRecord

if TYPE_CHECKING:
    from gateway.pd.exchange import PDExchange

access_log = logging.getLogger("kvgate.access")


def observe_request(metrics: GatewayMetrics, record: RequestRecord, *, limit: int | None) -> None:
    """At the end of a client request (its exchange may still be finishing: see observe_exchange)."""
    refused = record.refused
    model = record.model or (refused.model if refused is not None and refused.model else "")
    status = record.status or 499  # nginx's convention: the client left before any answer
    metrics.requests.labels(model, record.route, str(status)).inc()
    if refused is not None:
        metrics.rejections.labels(model, rejection_reason(refused.status, refused.code)).inc()
    if record.admission_s is not None:
        metrics.admission_seconds.labels(model).observe(record.admission_s)
    if record.queue_s is not None:
        metrics.queue_seconds.labels(model).observe(record.queue_s)
    exchange = record.exchange
    if exchange is not None:
        metrics.prompt_tokens.labels(model).observe(exchange.prompt_tokens)
        if limit:
            metrics.limit_ratio.labels(model).observe(exchange.prompt_tokens / limit)
    if not access_log.disabled and access_log.isEnabledFor(logging.INFO):  # off: not even its fields are built
        access_log.info("request", extra={"access": _access_fields(record, model, status)})


def observe_exchange(metrics: GatewayMetrics, exchange: PDExchange) -> None:
    """When both halves are closed and every abort answered."""
    model = exchange.admitted.model
    end = exchange.finished_at or exchange.started_at
    outcome = exchange.outcome
    metrics.duration.labels(model, outcome).observe(end - exchange.started_at)
    # A whole answer's arrival is not a first token: it would read as a slow one (and no inter-token gap either).
    if exchange.first_token_at is not None and exchange.admitted.stream:
        ttft = exchange.first_token_at - exchange.started_at
        metrics.ttft.labels(model).observe(ttft)
        if exchange.prompt_tokens >= 1024:
            metrics.ttft_per_1k.labels(model).observe(ttft / (exchange.prompt_tokens / 1000))
        last = exchange.decode_closed_at or end
        if exchange.output_events > 1:
            metrics.inter_token.labels(model).observe((last - exchange.first_token_at) / (exchange.output_events - 1))
    metrics.output_bytes.labels(model).inc(exchange.output_bytes)
    if outcome != "ok":
        metrics.cancellations.labels(model, outcome).inc()
    if exchange.implausible_ttft:
        metrics.implausible_ttft.labels(model).inc()
    gone = exchange.client_gone_at
    if gone is not None:
        prefill_held = max(0.0, (exchange.prefill_settled_at or end) - gone)
        decode_held = max(0.0, (exchange.decode_closed_at or end) - gone)
        if prefill_held > 0 or decode_held > 0:
            metrics.held_after_disconnect.labels(model).inc()
            metrics.held_seconds.labels("prefill").observe(prefill_held)
            metrics.held_seconds.labels("decode").observe(decode_held)
    for role, acknowledged in exchange.aborts:
        metrics.aborts.labels(role, "true" if acknowledged else "false").inc()
    if exchange.retries_made:
        metrics.retries.labels(model).inc(exchange.retries_made)
    if exchange.mismatch is not None:
        metrics.prompt_mismatches.labels(model, exchange.mismatch.role).inc()
    if outcome == "ok":  # both halves answered: the prompt was computed
        metrics.routed_prompt_tokens.labels(model).inc(exchange.prompt_tokens)
        if exchange.predicted_cached is not None:
            metrics.route_cached_predicted.labels(model).inc(exchange.predicted_cached)
        if exchange.prefill_cached is not None:
            metrics.prefill_cached.labels(model).inc(exchange.prefill_cached)


def _access_fields(record: RequestRecord, model: str, status: int) -> dict[str, object]:
    exchange = record.exchange
    fields: dict[str, object] = {"request_id": record.request_id, "route": record.route, "model": model,
                                 "status": status}
    if record.trace_id is not None:
        fields["trace_id"] = record.trace_id
    if record.refused is not None:
        fields["error_code"] = record.refused.code
    if exchange is not None:
        fields.update(rid=exchange.rid, prompt_tokens=exchange.prompt_tokens, prefill=exchange.pair.prefill.url,
                      decode=exchange.pair.decode.url, outcome=exchange.outcome, retries=exchange.retries_made,
                      output_bytes=exchange.output_bytes)
        if exchange.first_token_at is not None and exchange.admitted.stream:
            fields["ttft_ms"] = round((exchange.first_token_at - exchange.started_at) * 1000, 1)
    failure = exchange.failure.error if exchange is not None and exchange.failure is not None else record.refused
    if failure is not None and failure.status >= 500:  # the whole story, worker addresses included, for the operator
        fields["error"] = failure.detail or failure.message
    return fields
