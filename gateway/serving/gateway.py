"""The running gateway as one service: every part built at construction, started, drained and stopped in order, and
asked whether it is ready. What a request does lives in serving.flow; what follows the fleet, in serving.fleet."""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.admission.offload import AdmissionWorkers
from gateway.config import GatewayConfig
from gateway.integrity.provenance import ProvenanceChecker, ProvenanceWindow
from gateway.pd.exchange import PDExchange
from gateway.pd.registry import ExchangeRegistry, RoomAllocator
from gateway.serving.fleet import Fleet, fleet_report, follow_fleet
from gateway.serving.flow import Flow
from gateway.serving.inflight import Inflight
from gateway.serving.models import ServedModel, build_model, describe_refusal, dns_sources, health_spec
from gateway.telemetry.loop_lag import LoopLagProbe
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.observe import observe_exchange, observe_request
from gateway.telemetry.record import RequestRecord
from gateway.telemetry.tracing import Tracing
from routing.cache_tracking import CacheTracking
from routing.discovery import Discovery
from routing.engines.client import EngineClient
from routing.gate import ModelJudgement
from routing.loads import LoadPoller
from routing.membership import Membership
from routing.monitor import WorkerMonitor
from routing.prefix_index.subscriber import EventsEndpoint
from routing.retry_budget import RetryBudget

log = logging.getLogger("kvgate")


class GateRefused(Exception):
    """A model failed the KV-pool gate at startup and the gateway is not configured to start anyway."""

    def __init__(self, judgements: list[ModelJudgement]) -> None:
        super().__init__("\n".join(describe_refusal(j) for j in judgements))
        self.judgements = judgements


class Gateway:
    """Builds every service from the configuration (loading each model's tokenizer: seconds, in threads of their
    own), so nothing is half there: `start` only reads the engines, starts loops and joins the fleet."""

    def __init__(self, config: GatewayConfig, *, config_path: str | Path | None = None) -> None:
        self.metrics = metrics = GatewayMetrics()
        with ThreadPoolExecutor(max(1, len(config.models)), thread_name_prefix="kvgate-load") as loading:
            built = list(loading.map(lambda m: build_model(m, cache_bytes=config.token_cache_bytes), config.models))
        self.models: dict[str, ServedModel] = {model.name: model for model in built}
        self.admission_workers = AdmissionWorkers(config.models, workers=config.admission_processes,
                                                  cache_bytes=config.token_cache_bytes)
        timeouts = config.timeouts
        # A new connection's identity check may take as long as the slowest model's health read: an engine healthy
        # by its own model's standard is never "busy" at connect (busy timeouts do not reach its breaker).
        verify_timeout_s = max(config.health_of(m).timeout_s for m in config.models)
        self.engines = EngineClient(connect_timeout_s=timeouts.connect_s, verify_timeout_s=verify_timeout_s,
                                    abort_timeout_s=timeouts.abort_s)
        self.fleet = Fleet(config.state, config.auth, config.tenants, metrics)
        self.inflight = Inflight(self.fleet.state, metrics)
        self.exchanges = ExchangeRegistry(on_closed=self._exchange_closed)
        self.retry_budget = RetryBudget()
        self.flow = Flow(config, self.models, self.admission_workers, self.engines, self.exchanges, self.inflight,
                         self.retry_budget)
        self.monitor = WorkerMonitor(
            self.engines, [(m.spec, m.pool, health_spec(config.health_of(m.config))) for m in self.models.values()],
            self._follow_judgement)
        self.membership = Membership({name: model.pool for name, model in self.models.items()}, self.monitor)
        self.discovery = Discovery(self.membership, dns_sources(config), config.discovery.nameservers)
        for model in self.models.values():
            if model.config.routing.prefill_policy == "cache_aware":
                configured = {url: EventsEndpoint(e.endpoint, e.replay_endpoint, e.topic)
                              for url, e in model.config.kv_events_endpoints.items()}
                model.cache_tracking = CacheTracking(configured=configured,
                                                     liveness_s=config.health_of(model.config).interval_s,
                                                     follow_events=model.config.routing.kv_events != "off",
                                                     per_block_evictions=model.config.routing.kv_events == "per_block",
                                                     index_bytes=model.config.routing.cache_aware_index_bytes)
        self.load_pollers: dict[str, LoadPoller] = {}
        self.provenance_checker = ProvenanceChecker(metrics)
        self.loop_lag = LoopLagProbe(metrics.loop_lag)
        self.tracing = Tracing(config.tracing)
        self.config_path = config_path  # re-read by a reload (SIGHUP or POST /admin/reload)
        self.refusal: str | None = None  # why startup refused to serve, as printed for the operator
        self.shutting_down = False
        metrics.watch_workers(lambda: [(m.name, w) for m in self.models.values() for w in m.pool.workers])
        metrics.watch_token_caches(lambda: [(m.name, m.admission.counter.cache_stats) for m in self.models.values()])
        metrics.watch_kv_events(lambda: [(m.name, w, sub) for m in self.models.values()
                                         if m.cache_tracking is not None
                                         for w, sub in m.cache_tracking.subscribers.items()])

    @property
    def config(self) -> GatewayConfig:
        """The configuration in force (a reload replaces it; the flow reads it per request)."""
        return self.flow.config

    @config.setter
    def config(self, new: GatewayConfig) -> None:
        self.flow.config = new

    @property
    def rooms(self) -> RoomAllocator:
        return self.exchanges.rooms

    @property
    def provenance(self) -> dict[str, ProvenanceWindow]:
        return self.provenance_checker.windows

    async def start(self) -> None:
        for name, spec in await self.discovery.initial():  # workers DNS names now, in rotation once gated
            pool = self.models[name].pool
            worker = pool.new_worker(spec)
            pool.add(worker)
            self.monitor.watch(name, worker)
        for model in self.models.values():
            if model.cache_tracking is not None:  # every prefill gets a cache index, and a KV-event subscriber
                model.pool.follow(model.cache_tracking.attach, model.cache_tracking.detach)
        judgements = await self.monitor.verify_startup(self.config.gate.startup_timeout_s)
        refused = [j for j in judgements if not j.passes]
        if refused and not self.config.gate.start_anyway:
            error = GateRefused(refused)
            self.refusal = str(error)
            raise error
        self.monitor.start()
        self.loop_lag.start()
        for model in self.models.values():
            await self.poll_loads(model)
        self.discovery.start()
        await self.fleet.start(
            lambda: fleet_report(self.models.values(), self.inflight, shared=self.fleet.state.shared),
            lambda view: follow_fleet(view, self.models.values(), self.exchanges, self.inflight, self.metrics),
            self.abort_local)

    async def poll_loads(self, model: ServedModel) -> None:
        """Engines' own loads are read while, and only while, a policy uses them (power_of_two, kv_headroom)."""
        routing = model.config.routing
        running = self.load_pollers.pop(model.name, None)
        if running is not None:
            await running.stop()
        if routing.reads_engine_loads:
            pool = model.pool
            poller = LoadPoller(self.engines, lambda: pool.workers, interval_s=routing.load_poll_s)
            poller.start()
            self.load_pollers[model.name] = poller

    def begin_shutdown(self) -> None:
        """Refuse new requests (503) and report not ready; requests in flight go on."""
        if not self.shutting_down:
            log.info("shutting down: %d request(s) in flight, grace %gs", len(self.exchanges.running),
                     self.config.shutdown.grace_s)
        self.shutting_down = True

    async def drain(self, grace_s: float) -> None:
        """Let requests in flight finish for up to `grace_s`; cancel the rest on both halves, in the safe order."""
        self.begin_shutdown()
        cancelled = await self.exchanges.drain(timeout_s=grace_s)
        if cancelled:
            log.warning("shutdown grace of %gs over: %d request(s) cancelled on both halves", grace_s, cancelled)

    async def stop(self) -> None:
        await self.loop_lag.stop()
        await self.discovery.stop()
        for model in self.models.values():
            if model.cache_tracking is not None:
                await model.cache_tracking.stop()
        for poller in self.load_pollers.values():
            await poller.stop()
        await self.monitor.stop()
        await self.drain(grace_s=0 if self.shutting_down else self.config.shutdown.grace_s)
        await self.fleet.stop()
        await self.engines.close()
        self.admission_workers.close()
        self.tracing.shutdown()
        self.provenance_checker.close()
        for model in self.models.values():
            model.admission.counter.close()

    def ready(self) -> tuple[bool, dict[str, str]]:
        """Whether every model has a usable prefill and decode worker, with the reason for each that has not."""
        if self.shutting_down:
            return False, {model: "the gateway is shutting down" for model in self.models}
        problems = {}
        for model in self.models.values():
            if model.unavailable:
                problems[model.name] = model.unavailable
            elif not model.pool.ready():
                problems[model.name] = "no usable prefill and decode pair"
        return not problems, problems

    def abort_local(self, request_id: str) -> int:
        return self.inflight.abort(request_id)

    def observe_request(self, record: RequestRecord) -> None:
        """A client request is answered: metrics and its access line now; its trace once its exchange has closed."""
        served = self.models.get(record.model)
        limit = served.admission.limits.prompt_tokens if served else None
        if record.sampled and served is not None and record.status == 200:
            tokenizer = served.admission.tokenizer.tokenizer
            self.provenance_checker.submit(served.name, served.config.integrity.provenance_window, record,
                                           functools.partial(tokenizer.decode, skip_special_tokens=True))
        if record.probe:
            return  # the canary's own traffic: not a tenant's, kept out of request metrics and the access log
        observe_request(self.metrics, record, limit=limit)
        exchange = record.exchange
        if exchange is not None and not exchange.closed.done():
            exchange.closed.add_done_callback(lambda _: self.tracing.end_request(record, effective_limit=limit))
        else:
            self.tracing.end_request(record, effective_limit=limit)

    def _exchange_closed(self, exchange: PDExchange) -> None:
        observe_exchange(self.metrics, exchange)
        self.inflight.closed(exchange)

    def _follow_judgement(self, judgement: ModelJudgement, startup: bool) -> None:
        """The monitor's callback, on the event loop, before the next request is admitted."""
        self.models[judgement.model.name].follow(judgement, startup=startup, metrics=self.metrics,
                                                 start_anyway=self.config.gate.start_anyway)

    def model_for(self, name: str | None) -> ServedModel:
        return self.flow.model_for(name)

