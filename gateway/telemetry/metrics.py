"""Prometheus metrics, one or more per promise, in a registry of the gateway's own (several gateways can live in one
test process). Label values are bounded: configured model names (or "" before a model is known), routes, roles,
statuses, reason and cause codes, and the configured worker URLs — never request or tenant ids."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.admission.count_cache import CacheStats
from routing.prefix_index import CacheMode
from routing.prefix_index.subscriber import KvEventSubscriber
from routing.workers import Worker

disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` twin of every counter and histogram: twice the series, no use here

_TOKENS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
_RATIO = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_FAST_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_BREAKER_STATES = ("closed", "half_open", "open")
_CHECK_RESULTS = ("pass", "fail", "unverified")

# Why a request was answered before any engine saw it, from its status and code.
_REJECTION_REASONS = {
    "context_length_exceeded": "over_limit", "body_too_large": "body_too_large", "request_timeout": "body_timeout",
    "model_not_found": "unknown_model", "overloaded": "overloaded", "no_worker_available": "unavailable",
    "model_unavailable": "unavailable", "shutting_down": "shutting_down", "rate_limited": "rate_limited",
}


class _ChildrenByValues:
    """A labelled metric's children looked up in a dict: prometheus_client's `labels()` validates its values and
    takes a lock on every call, ~10 times per request here. (Label sets are never removed, so a child once made
    stays the metric's.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._children_by_values: dict[tuple[str, ...], Any] = {}

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]
        child = self._children_by_values.get(labelvalues)
        if child is None:
            child = self._children_by_values[labelvalues] = super().labels(*labelvalues)  # type: ignore[misc]
        return child


class Counter(_ChildrenByValues, prometheus_client.Counter):
    pass


class Gauge(_ChildrenByValues, prometheus_client.Gauge):
    pass


class Histogram(_ChildrenByValues, prometheus_client.Histogram):
    pass


def rejection_reason(status: int, code: str | None) -> str:
    if code in _REJECTION_REASONS:
        return _REJECTION_REASONS[code]
    if status == 404:
        return "unknown_model"
    return "bad_input" if 400 <= status < 500 else "other"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # ── requests and admission ──────────────────────────────────────────────────────────────────────────
        self.requests = Counter("kvgate_requests", "Client requests answered, by model, route and status (499: the "
                                "client left before any answer)", ["model", "route", "status"], registry=r)
        self.rejections = Counter("kvgate_admission_rejections", "Requests answered before any engine saw them, by "
                                  "reason", ["model", "reason"], registry=r)
        self.prompt_tokens = Histogram("kvgate_prompt_tokens", "Prompt tokens of admitted requests (the gateway's "
                                       "count)", ["model"], buckets=_TOKENS, registry=r)
        self.limit_ratio = Histogram("kvgate_prompt_limit_ratio", "Admitted prompt tokens / the model's effective "
                                     "limit: a cluster near 1 is a workload pressing on the limit", ["model"],
                                     buckets=_RATIO, registry=r)
        self.admission_seconds = Histogram("kvgate_admission_seconds", "Parsing, rendering and counting one request "
                                           "(reading its body excluded)", ["model"], buckets=_FAST_SECONDS,
                                           registry=r)
        self.queue_seconds = Histogram("kvgate_queue_wait_seconds", "Waiting for a worker with room", ["model"],
                                       buckets=_SECONDS, registry=r)
        # ── the exchange ────────────────────────────────────────────────────────────────────────────────────
        self.ttft = Histogram("kvgate_time_to_first_token_seconds", "Dispatch to decode's first token", ["model"],
                              buckets=_SECONDS, registry=r)
        self.ttft_per_1k = Histogram("kvgate_ttft_seconds_per_1k_prompt_tokens", "Time to first token per 1,000 "
                                     "prompt tokens, for prompts of 1,024 tokens or more: far below what prefill can "
                                     "do means the prompt was not really prefilled (the incident's placeholder)",
                                     ["model"], buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                         0.05, 0.1, 0.25, 1), registry=r)
        self.implausible_ttft = Counter("kvgate_implausible_ttft", "First tokens sooner than the model's prefill "
                                        "speed ceiling allows for the prompt (a leak that looks like success)",
                                        ["model"], registry=r)
        self.provenance_checks = Counter("kvgate_provenance_checks", "Sampled answers checked for another tenant's "
                                         "text", ["model"], registry=r)
        self.provenance_foreign = Counter("kvgate_provenance_foreign", "Sampled answers that share a long stretch of "
                                          "text with what one other tenant, and nobody else, recently sent", ["model"],
                                          registry=r)
        self.canary_probes = Counter("kvgate_canary_probes", "Canary probes sent through the gateway's own path, by "
                                     "result (status, leak, admitted_over_limit)", ["model", "result"], registry=r)
        self.canary_leaks = Counter("kvgate_canary_leaks", "Canary probes whose answer carried another probe's "
                                    "marker, or over-limit probes that were served", ["model"], registry=r)
        self.duration = Histogram("kvgate_request_duration_seconds", "Dispatch to the exchange's end, by outcome",
                                  ["model", "outcome"], buckets=_SECONDS, registry=r)
        self.inter_token = Histogram("kvgate_inter_token_seconds", "Mean time between decode events of a request",
                                     ["model"], buckets=_FAST_SECONDS, registry=r)
        self.cancellations = Counter("kvgate_cancellations", "Exchanges cancelled on both halves, by cause (the "
                                     "failure's code, or client_gone)", ["model", "cause"], registry=r)
        self.held_after_disconnect = Counter("kvgate_held_after_disconnect", "Requests whose client left while a "
                                             "half was still held (to prefill's end / decode's first token)",
                                             ["model"], registry=r)
        self.held_seconds = Histogram("kvgate_held_after_disconnect_seconds", "How long a half was held after its "
                                      "client left", ["role"], buckets=_SECONDS, registry=r)
        self.aborts = Counter("kvgate_aborts", "/abort_request calls sent, by role and whether the engine "
                              "acknowledged", ["role", "acknowledged"], registry=r)
        self.prompt_mismatches = Counter(
            "kvgate_prompt_token_mismatches", "Engine prompt counts that differed from the gateway's, caught before "
            "any output was released", ["model", "role"], registry=r)
        self.retries = Counter("kvgate_retries", "Requests moved to another pair before anything reached an engine",
                               ["model"], registry=r)
        # ── cache-aware routing: predicted against what the engines report ─────────────────────────────────────
        self.output_bytes = Counter("kvgate_output_bytes", "Decode payload bytes released to clients (prompt logprobs "
                                    "merged in included): what a tenant's answers cost to carry", ["model"],
                                    registry=r)
        self.routed_prompt_tokens = Counter("kvgate_prefilled_prompt_tokens", "Prompt tokens of requests whose "
                                            "prefill answered (the denominator of the two below)", ["model"],
                                            registry=r)
        self.route_cached_predicted = Counter("kvgate_route_cached_tokens_predicted", "Prompt tokens the "
                                              "cache-aware pick expected the chosen prefill to hold", ["model"],
                                              registry=r)
        self.prefill_cached = Counter("kvgate_prefill_cached_tokens", "Prompt tokens prefill engines reported "
                                      "taking from their radix cache (cached_tokens)", ["model"], registry=r)
        # ── the KV-pool gate and the workers ────────────────────────────────────────────────────────────────
        self.worker_pool_tokens = Gauge("kvgate_worker_kv_pool_tokens", "KV pool size an engine reports",
                                        ["model", "worker", "role"], registry=r)
        self.worker_max_req_input_len = Gauge("kvgate_worker_max_req_input_len",
                                              "max_req_input_len an engine reports", ["model", "worker", "role"],
                                              registry=r)
        self.worker_context_tokens = Gauge("kvgate_worker_context_length_tokens", "Effective context an engine reports",
                                           ["model", "worker", "role"], registry=r)
        self.worker_admitted = Gauge("kvgate_worker_admitted", "1 when the worker passes the KV-pool gate",
                                     ["model", "worker", "role"], registry=r)
        self.model_configured_limit = Gauge("kvgate_model_configured_prompt_limit_tokens",
                                            "Prompt limit from configuration", ["model"], registry=r)
        self.model_effective_limit = Gauge("kvgate_model_effective_prompt_limit_tokens",
                                           "Prompt limit enforced after measuring the pools", ["model"], registry=r)
        self.model_clamped = Gauge("kvgate_model_limit_clamped", "1 while the limit is clamped below configuration",
                                   ["model"], registry=r)
        self.model_available = Gauge("kvgate_model_available", "1 while the model is served", ["model"], registry=r)
        self.gate_verdict = Gauge("kvgate_gate_verdict", "1 for the KV-pool gate's latest verdict on the model "
                                  "(pass, warn, clamp, refuse)", ["model", "verdict"], registry=r)
        self.limit_clamps = Counter("kvgate_startup_limit_clamped", "Times a model's limit was clamped to its pools",
                                    ["model"], registry=r)
        # ── the fleet's shared state ────────────────────────────────────────────────────────────────────────────
        self.state_up = Gauge("kvgate_state_backend_up", "1 while the shared state (Redis) answers; memory: 1",
                              registry=r)
        self.state_up.set(1)
        self.state_errors = Counter("kvgate_state_backend_errors", "Shared-state calls that failed (timeout, "
                                    "connection), by operation", ["operation"], registry=r)
        self.operator_aborts = Counter("kvgate_operator_aborts", "Requests in flight cancelled by an operator (abort "
                                       "by request id, or a model's kill switch)", ["model"], registry=r)
        self.loop_lag = Histogram("kvgate_event_loop_lag_seconds", "How late a timer on the event loop fires",
                                  buckets=_FAST_SECONDS, registry=r)

    def watch_token_caches(self, stats: Callable[[], Iterable[tuple[str, CacheStats]]]) -> None:
        self.registry.register(_TokenCacheCollector(stats))

    def watch_workers(self, workers: Callable[[], Iterable[tuple[str, Worker]]]) -> None:
        self.registry.register(_WorkerCollector(workers))

    def watch_kv_events(self, subscribers: Callable[[], Iterable[tuple[str, Worker, KvEventSubscriber]]]) -> None:
        self.registry.register(_KvEventsCollector(subscribers))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TokenCacheCollector(Collector):
    def __init__(self, stats: Callable[[], Iterable[tuple[str, CacheStats]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        hits = CounterMetricFamily("kvgate_token_cache_hits", "Token-count cache hits", labels=["model"])
        misses = CounterMetricFamily("kvgate_token_cache_misses", "Token-count cache misses", labels=["model"])
        size = GaugeMetricFamily("kvgate_token_cache_bytes", "Bytes held by the token-count cache", labels=["model"])
        for model, stats in self._stats():
            hits.add_metric([model], stats.hits)
            misses.add_metric([model], stats.misses)
            size.add_metric([model], stats.bytes)
        yield from (hits, misses, size)


class _WorkerCollector(Collector):
    """Each worker's live state, read at scrape time from the workers themselves (no second copy to keep in step)."""

    def __init__(self, workers: Callable[[], Iterable[tuple[str, Worker]]]) -> None:
        self._workers = workers

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["model", "worker", "role"]
        in_flight = GaugeMetricFamily("kvgate_worker_in_flight", "Requests in flight on the worker through this "
                                      "gateway", labels=labels)
        healthy = GaugeMetricFamily("kvgate_worker_healthy", "1 while the worker's health checks pass",
                                    labels=labels)
        in_rotation = GaugeMetricFamily("kvgate_worker_in_rotation", "1 while the worker may get new requests",
                                        labels=labels)
        breaker = GaugeMetricFamily("kvgate_worker_breaker_state", "1 for the circuit breaker's current state",
                                    labels=[*labels, "state"])
        checks = GaugeMetricFamily("kvgate_worker_check", "1 for each deployment check's current result (pass, fail, "
                                   "unverified)", labels=[*labels, "check", "result"])
        for model, worker in self._workers():
            key = [model, worker.url, worker.role]
            in_flight.add_metric(key, worker.in_flight)
            healthy.add_metric(key, 1 if worker.healthy else 0)
            in_rotation.add_metric(key, 1 if worker.usable else 0)
            for state in _BREAKER_STATES:
                breaker.add_metric([*key, state], 1 if worker.breaker_state.value == state else 0)
            for outcome in worker.checks:
                for result in _CHECK_RESULTS:
                    checks.add_metric([*key, outcome.check, result], 1 if outcome.result == result else 0)
        yield from (in_flight, healthy, in_rotation, breaker, checks)


class _KvEventsCollector(Collector):
    """Cache-aware routing's view of each prefill: which mode its index is in, what its KV events did, how big it is."""

    def __init__(self, subscribers: Callable[[], Iterable[tuple[str, Worker, KvEventSubscriber]]]) -> None:
        self._subscribers = subscribers

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["model", "worker"]
        mode = GaugeMetricFamily("kvgate_kv_events_mode", "1 for the mode the worker's cache index is in: exact "
                                 "(every KV event since the engine's cache was empty), partial (events, history "
                                 "missing), approximate (publisher down or silent: what kvgate sent)",
                                 labels=[*labels, "mode"])
        batches = CounterMetricFamily("kvgate_kv_events_batches", "KV event batches received", labels=labels)
        malformed = CounterMetricFamily("kvgate_kv_events_malformed", "KV event messages skipped as malformed",
                                        labels=labels)
        gaps = CounterMetricFamily("kvgate_kv_events_gaps", "Sequence gaps, by whether replay filled them",
                                   labels=[*labels, "outcome"])
        restarts = CounterMetricFamily("kvgate_kv_events_publisher_restarts", "Publishers seen to start over",
                                       labels=labels)
        # Only what kvgate sent: the engine's view counts namespace-blind blocks (one for equal prompts of two
        # tenants), so on this unauthenticated endpoint it told a tenant whether another held its prompt. The
        # operator's /admin/workers still has it.
        blocks = GaugeMetricFamily("kvgate_cache_index_blocks", "Blocks in the worker's cache index, by view (sent: "
                                   "what kvgate sent)", labels=[*labels, "view"])
        for model, worker, subscriber in self._subscribers():
            key = [model, worker.url]
            for each in CacheMode:
                mode.add_metric([*key, each.value], 1 if subscriber.mode is each else 0)
            stats = subscriber.stats
            batches.add_metric(key, stats.batches)
            malformed.add_metric(key, stats.malformed)
            gaps.add_metric([*key, "replayed"], stats.gaps_replayed)
            gaps.add_metric([*key, "lost"], stats.gaps_lost)
            restarts.add_metric(key, stats.restarts)
            blocks.add_metric([*key, "sent"], subscriber.index.sent_blocks)
        yield from (mode, batches, malformed, gaps, restarts, blocks)
