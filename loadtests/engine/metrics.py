"""`sglang:` Prometheus metrics (§3 of the protocol notes), in a private registry per process."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # SGLang's multiprocess registry exports no *_created series

_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)


class Metrics:
    def __init__(self, model: str, role: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        sched = {"model_name": model, "engine_type": role, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        tok = {"model_name": model}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, list(sched), registry=r).labels(**sched)

        def counter(name: str, doc: str, labels: dict[str, str]) -> Counter:
            return Counter(f"sglang:{name}", doc, list(labels), registry=r).labels(**labels)

        self.num_running_reqs = gauge("num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("token_usage", "The token usage.")
        self.max_total_num_tokens = gauge("max_total_num_tokens", "Maximum total number of tokens in the KV pool.")
        self.cache_hit_rate = gauge("cache_hit_rate", "The prefix cache hit rate.")
        self.gen_throughput = gauge("gen_throughput", "The generation throughput (token/s).")
        self.prefill_prealloc = gauge("num_prefill_prealloc_queue_reqs", "Requests in the prefill bootstrap queue.")
        self.prefill_inflight = gauge("num_prefill_inflight_queue_reqs", "Requests in the prefill inflight queue.")
        self.decode_prealloc = gauge("num_decode_prealloc_queue_reqs", "Requests in the decode prealloc queue.")
        self.decode_transfer = gauge("num_decode_transfer_queue_reqs", "Requests in the decode transfer queue.")
        self.bootstrap_failed = counter("num_bootstrap_failed_reqs", "Bootstrap failed requests.", sched)
        self.transfer_failed = counter("num_transfer_failed_reqs", "Transfer failed requests.", sched)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.", tok)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.", tok)
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.", tok)
        self.num_requests = counter("num_requests", "Number of requests processed.", tok)
        self.num_aborted = counter("num_aborted_requests", "Number of requests aborted.", tok)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              list(tok), buckets=_TTFT_BUCKETS, registry=r).labels(**tok)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             list(tok), buckets=_E2E_BUCKETS, registry=r).labels(**tok)

    def render(self, refresh: Callable[[Metrics], None]) -> bytes:
        refresh(self)  # gauges are sampled at scrape time instead of on every request
        return generate_latest(self.registry)
