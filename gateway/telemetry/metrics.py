"""Prometheus metrics, in a registry of the gateway's own (several gateways can live in one test process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.admission.count_cache import CacheStats


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_requests", "Client requests answered, by route and status",
                                ["route", "status"], registry=r)
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
        self.prompt_mismatches = Counter(
            "kvgate_prompt_token_mismatches", "Engine prompt counts that differed from the gateway's, caught before "
            "any output was released", ["model", "role"], registry=r)
        self.retries = Counter("kvgate_retries", "Requests moved to another pair before anything reached an engine",
                               ["model"], registry=r)
        self.overloaded = Counter("kvgate_overloaded", "Requests refused with 503 and Retry-After: every worker full "
                                  "and the wait queue full or timed out", ["model"], registry=r)
        self.limit_clamps = Counter("kvgate_startup_limit_clamped", "Times a model's limit was clamped to its pools",
                                    ["model"], registry=r)

    def watch_token_caches(self, stats: Callable[[], Iterable[tuple[str, CacheStats]]]) -> None:
        self.registry.register(_TokenCacheCollector(stats))

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
