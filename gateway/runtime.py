"""The running gateway: served models, their worker pools, the engine client and every in-flight exchange."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Collection, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.admission.admit import Admission, AdmittedRequest, PromptLimits
from gateway.admission.chat import NOT_TEMPLATE_VARIABLES, ChatSettings, with_engine_defaults
from gateway.admission.dialects import Dialect, dialect_for
from gateway.admission.offload import AdmissionWorkers, ModelState
from gateway.admission.pipeline import admit_body, build_admission, resolve_model
from gateway.admission.requests import Route
from gateway.body import RequestBody
from gateway.config import GatewayConfig, HealthConfig, ModelConfig
from gateway.errors import GatewayError
from gateway.fleet import Fleet
from gateway.lifecycle import ExchangeRegistry, PDExchange, Retries, RoomAllocator, TTFTPlausibility
from gateway.preflight import describe_refusal
from gateway.tenancy.limiter import TenantPass
from gateway.provenance import ProvenanceWindow, answer_text, texts_in
from gateway.telemetry.loop_lag import LoopLagProbe
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.observe import observe_exchange, observe_request
from gateway.telemetry.record import RequestRecord
from gateway.telemetry.tracing import Tracing
from routing.breaker import BreakerSpec
from routing.deployment_checks import CheckPolicy
from routing.discovery import Discovery, DnsSource, initial_specs, make_resolver
from routing.engines.client import EngineClient
from routing.gate import ModelJudgement
from routing.loads import LoadPoller
from routing.membership import Membership
from routing.monitor import WorkerMonitor
from routing.policies import NO_KEY, RouteKey, make_policy
from routing.prefix_index import PromptTokens
from routing.prefix_index.subscriber import EventsEndpoint
from routing.prefix_index.tracking import CacheTracking
from routing.pools import Lease, ModelPool, NoWorkerAvailable, PoolSaturated, pool_for
from routing.retry_budget import RetryBudget
from routing.specs import HealthSpec, ModelSpec, PoolLimits
from routing.state import FleetReport, FleetView
from routing.stable_hash import stable_hash
from routing.workers import Worker, WorkerSpec

log = logging.getLogger("kvgate")

# The dialect assumed for a model none of whose workers has been verified yet (its requests get 503 anyway).
_DEFAULT_DIALECTS = frozenset({Dialect.V0_5_23})


@dataclass(slots=True)
class ServedModel:
    config: ModelConfig
    spec: ModelSpec
    admission: Admission
    pool: ModelPool
    # Set when the KV-pool gate refuses the model: it then answers 503. The reason worker by worker (for /readyz and
    # the log), and what a client reads (what is wrong, not the workers' addresses).
    unavailable: str | None = None
    unavailable_publicly: str | None = None
    # A model refused at startup stays refused until every one of its workers passes again.
    refused_at_startup: bool = False
    disabled: bool = False  # the fleet-wide kill switch: an operator turned the model off (503)
    _chat_with_defaults: tuple[str, ChatSettings, ChatSettings] | None = None  # (defaults, base, applied)
    fleet_limit: int | None = None  # the lowest prompt limit any live replica's gate measured
    cache_tracking: CacheTracking | None = None  # cache_aware: the prefills' cache indexes and KV-event subscribers

    @property
    def refusal(self) -> str | None:
        """Why requests for the model get 503 now, or None while it is served."""
        if self.disabled:
            return "the model is disabled by an operator (fleet-wide kill switch)"
        return self.unavailable_publicly

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def chat_settings(self) -> ChatSettings:
        """The model's chat settings with its verified engines' default template kwargs, which kvgate applies."""
        defaults = self.engine_template_defaults()
        if defaults is None:
            return self.admission.chat
        base, cached = self.admission.chat, self._chat_with_defaults
        if cached is None or cached[0] != defaults or cached[1] is not base:
            cached = self._chat_with_defaults = (defaults, base, with_engine_defaults(base, defaults))
        return cached[2]

    def engine_template_defaults(self) -> str | None:
        """The --default-chat-template-kwargs (JSON) most verified workers run with; the deployment check keeps a
        worker with others out of rotation (under its default policy)."""
        found = Counter(w.verified.rendering.default_chat_template_kwargs for w in self.pool.workers
                        if w.verified is not None)
        return found.most_common(1)[0][0] if found else None

    def route_key(self, admitted: AdmittedRequest, headers: list[tuple[bytes, bytes]], salt: str) -> RouteKey:
        """What the model's policies route this request by. The prefix is hashed with the engines' cache salt: two
        tenants' equal prompts share no cached pages, so sending them to one engine would promise hits it cannot
        serve."""
        session = None
        header = self.affinity_header
        if header is not None:
            value = next((v for k, v in headers if k == header), None)
            session = stable_hash(value) if value is not None else None
        prompt = None
        if self.config.routing.needs_prompt_sizes:
            # The namespace is the engines' own (the extra_key both halves carry): SGLang caches per it.
            prompt = PromptTokens(admitted.route_ids or b"", tokens=admitted.most_prompt_tokens, namespace=salt,
                                  max_new_tokens=admitted.max_new_tokens)
        if admitted.prefix_hash is None and session is None and prompt is None:
            return NO_KEY
        prefix = None if admitted.prefix_hash is None else \
            stable_hash(admitted.prefix_hash.to_bytes(8, "little"), salt.encode())
        return RouteKey(prefix=prefix, session=session, prompt=prompt)

    @property
    def affinity_header(self) -> bytes | None:
        name = self.config.routing.affinity_header
        return name.encode("latin-1") if name else None

    def dialects(self) -> frozenset[Dialect]:
        """The SGLang dialects of the model's verified workers: a chat is counted once for each."""
        found = frozenset(dialect_for(w.verified.version) for w in self.pool.workers if w.verified is not None)
        return found or _DEFAULT_DIALECTS


def model_spec(config: ModelConfig) -> ModelSpec:
    limits, breaker = config.limits, config.circuit_breaker
    return ModelSpec(
        name=config.name, context_length=config.context_length,
        configured_prompt_limit=config.configured_prompt_limit, on_pool_mismatch=config.on_pool_mismatch,
        min_engine_version=config.min_engine_version, on_old_engine=config.on_old_engine,
        prefill=tuple(WorkerSpec(w.url, "prefill", getattr(w, "bootstrap_port", None))
                      for w in config.static_workers("prefill")),
        decode=tuple(WorkerSpec(w.url, "decode") for w in config.static_workers("decode")),
        limits=PoolLimits(limits.max_inflight_per_worker, limits.max_queue, limits.queue_timeout_s),
        breaker=BreakerSpec(breaker.failure_threshold, breaker.success_threshold, breaker.open_s),
        checks=CheckPolicy(**config.deployment_checks.model_dump(),
                           chat_template_configured=config.chat_template is not None,
                           unmergeable_template_kwargs=NOT_TEMPLATE_VARIABLES))


def _plausibility(config: ModelConfig) -> TTFTPlausibility | None:
    rule = config.integrity
    if rule.max_prefill_tokens_per_s is None:
        return None
    return TTFTPlausibility(rule.max_prefill_tokens_per_s, rule.min_prompt_tokens, rule.strict)


def _engine_headers(traceparent: str | None, request_id: str | None) -> tuple[tuple[bytes, bytes], ...]:
    """What both engine requests carry besides the body: the trace context and the client's request id."""
    headers = []
    if traceparent:
        headers.append((b"traceparent", traceparent.encode()))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    return tuple(headers)


def dns_sources(config: GatewayConfig) -> list[DnsSource]:
    return [DnsSource(model.name, role, entry.name, entry.port, entry.bootstrap_port, entry.interval_s, entry.scheme)
            for model in config.models for role in ("prefill", "decode") for entry in model.dns_workers(role)]


def health_spec(health: HealthConfig) -> HealthSpec:
    return HealthSpec(health.interval_s, health.timeout_s, health.failure_threshold, health.success_threshold,
                      health.path)


def build_model(config: ModelConfig, *, cache_bytes: int) -> ServedModel:
    """Load the tokenizer and chat template (slow: call off the event loop) and lay out the worker pool."""
    spec = model_spec(config)
    routing = config.routing
    max_age_s = 3 * routing.load_poll_s
    pool = pool_for(spec, prefill_policy=make_policy(routing.prefill_policy, load_max_age_s=max_age_s),
                    decode_policy=make_policy(routing.decode_policy, load_max_age_s=max_age_s))
    return ServedModel(config, spec, build_admission(config, cache_bytes=cache_bytes), pool)


class GateRefused(Exception):
    """A model failed the KV-pool gate at startup and the gateway is not configured to start anyway."""

    def __init__(self, judgements: list[ModelJudgement]) -> None:
        super().__init__("\n".join(describe_refusal(j) for j in judgements))
        self.judgements = judgements


class Gateway:
    def __init__(self, config: GatewayConfig, *, config_path: str | Path | None = None) -> None:
        self.config = config
        self.config_path = config_path  # re-read by a reload (SIGHUP or POST /admin/reload)
        self.models: dict[str, ServedModel] = {}
        self.exchanges = ExchangeRegistry()
        self.rooms = RoomAllocator()
        self.metrics = GatewayMetrics()
        self.engines: EngineClient | None = None
        self.monitor: WorkerMonitor | None = None
        self.membership: Membership | None = None
        self.discovery: Discovery | None = None
        self.admission_workers: AdmissionWorkers | None = None
        self.load_pollers: dict[str, LoadPoller] = {}
        self.retry_budget = RetryBudget()
        self.judgements: dict[str, ModelJudgement] = {}
        self.refusal: str | None = None  # why startup refused to serve, as printed for the operator
        self.shutting_down = False
        self.loop_lag = LoopLagProbe(self.metrics.loop_lag)
        self.tracing = Tracing(config.tracing)
        self.provenance: dict[str, ProvenanceWindow] = {}
        self.fleet = Fleet(config.state, config.auth, config.tenants, self.metrics)
        self._by_request_id: dict[str, set[PDExchange]] = {}  # for aborts by x-request-id
        self._queued: Counter[str] = Counter()  # request ids waiting for a worker pair (admitted, not dispatched)
        self._abort_queued: set[str] = set()  # ... of which an operator aborted these: refused when their turn comes
        self._passes: dict[PDExchange, TenantPass] = {}  # each exchange's hold on its tenant's limits
        self._state_calls: set[asyncio.Task[None]] = set()
        self._provenance_thread = ThreadPoolExecutor(1, thread_name_prefix="kvgate-provenance")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        built = await asyncio.gather(*(
            loop.run_in_executor(None, lambda m=m: build_model(m, cache_bytes=self.config.token_cache_bytes))
            for m in self.config.models))
        self.models = {model.name: model for model in built}
        self.admission_workers = AdmissionWorkers(self.config.models, workers=self.config.admission_workers,
                                                  cache_bytes=self.config.token_cache_bytes)
        timeouts = self.config.timeouts
        # A new connection's identity check may take as long as the slowest model's health read: an engine healthy
        # by its own model's standard is never "busy" at connect (busy timeouts do not reach its breaker).
        verify_timeout_s = max(self.config.health_of(m).timeout_s for m in self.config.models)
        self.engines = EngineClient(connect_timeout_s=timeouts.connect_s, verify_timeout_s=verify_timeout_s,
                                    abort_timeout_s=timeouts.abort_s)
        self.metrics.watch_workers(
            lambda: [(m.name, w) for m in self.models.values() for w in m.pool.workers])
        self.metrics.watch_token_caches(
            lambda: [(m.name, m.admission.counter.cache_stats) for m in self.models.values()])
        sources = dns_sources(self.config)
        resolver = make_resolver(self.config.discovery.nameservers) if sources else None
        if resolver is not None:
            for name, spec in await initial_specs(resolver, sources):
                pool = self.models[name].pool
                pool.add(pool.new_worker(spec))
        for model in self.models.values():
            self._track_caches(model)
        self.metrics.watch_kv_events(lambda: [(m.name, w, sub) for m in self.models.values()
                                              if m.cache_tracking is not None
                                              for w, sub in m.cache_tracking.subscribers.items()])
        self.monitor = WorkerMonitor(
            self.engines, [(m.spec, m.pool, health_spec(self.config.health_of(m.config))) for m in self.models.values()],
            self._apply_judgement)
        self.membership = Membership({name: model.pool for name, model in self.models.items()}, self.monitor)
        judgements = await self.monitor.verify_startup(self.config.gate.startup_timeout_s)
        refused = [j for j in judgements if not j.passes]
        if refused and not self.config.gate.start_anyway:
            error = GateRefused(refused)
            self.refusal = str(error)
            raise error
        self.monitor.start()
        self.loop_lag.start()
        for model in self.models.values():
            await self._poll_loads(model)
        if resolver is not None:
            self.discovery = Discovery(self.membership, sources, resolver)
            self.discovery.start()
        await self.fleet.start(self._fleet_report, self._apply_fleet_view)

    def _track_caches(self, model: ServedModel) -> None:
        """cache_aware: every prefill worker gets a cache index, and a KV-event subscriber where events are there."""
        if model.config.routing.prefill_policy != "cache_aware":
            return
        configured = {url: EventsEndpoint(e.endpoint, e.replay_endpoint, e.topic)
                      for url, e in model.config.kv_events_endpoints.items()}
        tracking = model.cache_tracking = CacheTracking(
            configured=configured, liveness_s=self.config.health_of(model.config).interval_s,
            follow_events=model.config.routing.kv_events == "auto")
        model.pool.follow(tracking.attach, tracking.detach)

    async def _poll_loads(self, model: ServedModel) -> None:
        """Engines' own loads are read while, and only while, a policy uses them (power_of_two, kv_headroom)."""
        routing = model.config.routing
        running = self.load_pollers.pop(model.name, None)
        if running is not None:
            await running.stop()
        if routing.reads_engine_loads:
            assert self.engines is not None
            poller = LoadPoller(self.engines, lambda pool=model.pool: pool.workers, interval_s=routing.load_poll_s)
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
        if self.discovery is not None:
            await self.discovery.stop()
        for model in self.models.values():
            if model.cache_tracking is not None:
                await model.cache_tracking.stop()
        for poller in self.load_pollers.values():
            await poller.stop()
        if self.monitor is not None:
            await self.monitor.stop()
        await self.drain(grace_s=0 if self.shutting_down else self.config.shutdown.grace_s)
        await self.fleet.stop()
        if self.engines is not None:
            await self.engines.close()
        if self.admission_workers is not None:
            self.admission_workers.close()
        self.tracing.shutdown()
        self._provenance_thread.shutdown(wait=False, cancel_futures=True)
        for model in self.models.values():
            model.admission.counter.close()

    async def apply_config(self, new: GatewayConfig) -> list[str]:
        """Apply a configuration that `reload.restart_needed` accepted; returns what changed."""
        assert self.monitor is not None and self.membership is not None
        changes: list[str] = []
        for name, model in self.models.items():
            before, after = model.config, new.model(name)
            assert after is not None
            if after == before and new.health_of(after) == self.config.health_of(before):
                continue
            model.config, model.spec = after, model_spec(after)
            routing, max_age_s = after.routing, 3 * after.routing.load_poll_s
            model.pool.reconfigure(limits=model.spec.limits, breaker=model.spec.breaker,
                                   prefill_policy=make_policy(routing.prefill_policy, load_max_age_s=max_age_s),
                                   decode_policy=make_policy(routing.decode_policy, load_max_age_s=max_age_s))
            self.monitor.update(model.spec, health_spec(new.health_of(after)))
            await self._poll_loads(model)
            changes += await self._apply_workers(model, before, after)
            await self.monitor.verify_now(name)  # the gate again, with the new limits: it updates admission
            changes.append(f"model {name}: settings applied")
        if (new.auth, new.tenants) != (self.config.auth, self.config.tenants):
            self.fleet.reconfigure_tenants(new.auth, new.tenants)  # revoked keys and new limits: next request
            changes.append("tenants and auth applied")
        self.config = new
        return changes

    async def _apply_workers(self, model: ServedModel, before: ModelConfig, after: ModelConfig) -> list[str]:
        assert self.membership is not None
        old, new = model_spec(before), model.spec
        changes = []
        for spec in [*old.prefill, *old.decode]:
            if spec not in (*new.prefill, *new.decode):
                member = self.membership.find_url(model.name, spec.role, spec.url)
                if member is not None:
                    self.membership.remove(member)
                    changes.append(f"{spec.role} {spec.url} drained and removed")
        for spec in [*new.prefill, *new.decode]:
            if spec not in (*old.prefill, *old.decode):
                existing = self.membership.find_url(model.name, spec.role, spec.url)
                if existing is not None:  # e.g. its bootstrap port changed: out first
                    self.membership.remove(existing)
                worker = model.pool.new_worker(spec)
                model.pool.add(worker)  # out of rotation until the gate passes it, like any configured worker
                self.monitor.watch(model.name, worker)
                changes.append(f"{spec.role} {spec.url} added (in rotation once the gate passes it)")
        return changes

    def model_for(self, name: str | None) -> ServedModel:
        return resolve_model(name, self.models, lambda model: model.refusal)

    async def admit(self, route: Route, body: RequestBody, *, tenant: str) -> tuple[ServedModel, AdmittedRequest]:
        """Count and check a body: on the event loop when it is small, in an admission worker when it is large."""
        raw = body.in_memory
        if raw is not None:
            admitted = await admit_body(route, raw, tenant=tenant, find_model=self.model_for)
        else:
            assert self.admission_workers is not None and body.path is not None
            state = {m.name: ModelState(m.admission.limits, m.dialects(), m.refusal, m.engine_template_defaults())
                     for m in self.models.values()}
            admitted = await self.admission_workers.admit(route, body.path, tenant=tenant, state=state)
        return self.models[admitted.model], admitted

    def dispatch(self, model: ServedModel, lease: Lease, admitted: AdmittedRequest,
                 key: RouteKey = NO_KEY, *, traceparent: str | None = None,
                 request_id: str | None = None, tenant_pass: TenantPass | None = None,
                 cache_salt: str | None = None) -> PDExchange:
        assert self.engines is not None

        def repick(tried: Collection[Worker]) -> Lease | None:
            try:
                return model.pool.pick_pair(key, exclude=tried)
            except (NoWorkerAvailable, PoolSaturated):
                return None

        self.retry_budget.deposit()
        retries = Retries(model.config.routing.retries, repick, self.retry_budget)
        exchange = PDExchange(self.engines, lease, admitted, timeouts=self.config.timeouts,
                              release=model.config.release, registry=self.exchanges, rooms=self.rooms,
                              on_closed=self._exchange_closed, retries=retries,
                              engine_headers=_engine_headers(traceparent, request_id),
                              plausibility=_plausibility(model.config), cache_salt=cache_salt,
                              on_output=tenant_pass.output_so_far if tenant_pass and tenant_pass.charges_output
                              else None)
        if tenant_pass is not None:
            self._passes[exchange] = tenant_pass
        if request_id is not None:  # registered in the fleet since queue_begin; forgotten when the exchange closes
            exchange.request_id = request_id
            self._by_request_id.setdefault(request_id, set()).add(exchange)
        exchange.start()
        return exchange

    # ── requests by id: queued, then dispatched (an operator's abort reaches both) ──────────────────────────────
    def queue_begin(self, request_id: str) -> None:
        """An admitted request starts waiting for a worker pair: abortable by its id from now on, fleet-wide."""
        self._queued[request_id] += 1
        if self.fleet.state.shared:  # one replica: the local maps are the whole registry
            self._spawn_state_call(self.fleet.state.register_request(request_id))

    def queue_end(self, request_id: str, *, dispatched: bool) -> bool:
        """It stopped waiting; True when an operator aborted it meanwhile (it must then not be dispatched). One that
        will not be dispatched leaves the fleet's registry here (a dispatched one when its exchange closes)."""
        self._queued[request_id] -= 1
        aborted = request_id in self._abort_queued
        if self._queued[request_id] <= 0:
            del self._queued[request_id]
            self._abort_queued.discard(request_id)
        if (aborted or not dispatched) and self.fleet.state.shared:
            self._spawn_state_call(self.fleet.state.unregister_request(request_id))
        return aborted

    def abort_local(self, request_id: str) -> int:
        """Cancel, on both halves, every exchange of this replica that carries `request_id`, and refuse those still
        waiting for a pair when their turn comes; how many."""
        exchanges = list(self._by_request_id.get(request_id, ()))
        for exchange in exchanges:
            self.metrics.operator_aborts.labels(exchange.admitted.model).inc()
            exchange.fail(GatewayError(503, "the request was aborted by an operator", code="aborted_by_operator"))
        waiting = self._queued.get(request_id, 0)
        if waiting:
            self._abort_queued.add(request_id)
        return len(exchanges) + waiting

    def _spawn_state_call(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._state_calls.add(task)
        task.add_done_callback(self._state_calls.discard)

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

    def samples_provenance(self, model: ServedModel) -> bool:
        rate = model.config.integrity.provenance_sample
        return rate > 0 and random.random() < rate

    def observe_request(self, record: RequestRecord) -> None:
        """A client request is answered: metrics and its access line now; its trace once its exchange has closed."""
        served = self.models.get(record.model)
        limit = served.admission.limits.prompt_tokens if served else None
        if record.sampled and served is not None and record.status == 200:
            # Hashing a long prompt or answer takes tens of ms: one thread of its own, off the event loop (one
            # thread, so the window needs no lock).
            self._provenance_thread.submit(self._check_provenance_safely, served, record)
        if record.probe:
            return  # the canary's own traffic: not a tenant's, kept out of request metrics and the access log
        observe_request(self.metrics, record, limit=limit)
        exchange = record.exchange
        if exchange is not None and not exchange.closed.done():
            exchange.closed.add_done_callback(lambda _: self.tracing.end_request(record, effective_limit=limit))
        else:
            self.tracing.end_request(record, effective_limit=limit)

    def _check_provenance_safely(self, model: ServedModel, record: RequestRecord) -> None:
        try:
            self._check_provenance(model, record)
        except Exception:  # a check must never take anything else down
            log.exception("provenance check failed for request_id=%s", record.request_id)

    def _check_provenance(self, model: ServedModel, record: RequestRecord) -> None:
        """Does the answer share a long stretch with what another tenant recently sent? Counted and logged (never the
        text); then this request's prompt joins the window."""
        window = self.provenance.get(model.name)
        if window is None:
            window = self.provenance[model.name] = ProvenanceWindow(model.config.integrity.provenance_window)
        answer = answer_text(bytes(record.answer))
        self.metrics.provenance_checks.labels(model.name).inc()
        if window.foreign(record.tenant, answer):
            self.metrics.provenance_foreign.labels(model.name).inc()
            exchange = record.exchange
            log.error("answer shares text with another tenant's recent traffic: request_id=%s rid=%s model=%s "
                      "prefill=%s decode=%s", record.request_id, exchange.rid if exchange else None, model.name,
                      exchange.pair.prefill.url if exchange else None, exchange.pair.decode.url if exchange else None)
        admitted = record.admitted
        if admitted is not None and len(admitted.engine_body) <= 1 << 20:
            # Prompts only: two tenants asking alike may get alike answers (greedy decoding, common facts), but an
            # answer carrying someone else's prompt text is the leak's signature.
            window.remember(record.tenant, texts_in(orjson.loads(admitted.engine_body)))

    def _exchange_closed(self, exchange: PDExchange) -> None:
        observe_exchange(self.metrics, exchange)
        tenant_pass = self._passes.pop(exchange, None)
        if tenant_pass is not None:
            tenant_pass.release(output_tokens=exchange.output_tokens or exchange.output_events)
        request_id = exchange.request_id
        if request_id is not None:
            same = self._by_request_id.get(request_id)
            if same is not None:
                same.discard(exchange)
                if not same:
                    del self._by_request_id[request_id]
            if self.fleet.state.shared:
                self._spawn_state_call(self.fleet.state.unregister_request(request_id))

    # ── the fleet ───────────────────────────────────────────────────────────────────────────────────────────
    def _fleet_report(self) -> FleetReport:
        loads = {w.url: w.in_flight for m in self.models.values() for w in m.pool.workers}
        limits = {name: j.effective_limit for name, j in self.judgements.items() if j.effective_limit > 0}
        if not self.fleet.state.shared:  # one replica: no registry to publish
            return FleetReport(loads=loads, limits=limits)
        requests = Counter({request_id: len(held) for request_id, held in self._by_request_id.items()})
        requests.update(self._queued)
        return FleetReport(loads=loads, limits=limits, requests=requests)

    def _apply_fleet_view(self, view: FleetView) -> None:
        """Follow the fleet: other replicas' load on each worker, the lowest measured limit, kill switches, aborts."""
        for model in self.models.values():
            for worker in model.pool.workers:
                worker.note_fleet_load(view.loads_elsewhere.get(worker.url, 0))
            fleet_limit = view.limits.get(model.name)
            if fleet_limit != model.fleet_limit:
                model.fleet_limit = fleet_limit
                judgement = self.judgements.get(model.name)
                if judgement is not None:
                    self._update_limits(model, judgement)
            self._follow_kill_switch(model, view.disabled)
        for request_id in view.aborts:
            self.abort_local(request_id)

    def _follow_kill_switch(self, model: ServedModel, switches: dict[str, bool]) -> None:
        disabled = model.name in switches
        if disabled != model.disabled:
            model.disabled = disabled
            log.warning("model %s %s fleet-wide by an operator", model.name, "disabled" if disabled else "enabled")
            self.metrics.model_available.labels(model.name).set(0 if model.refusal else 1)
        if disabled and switches[model.name]:
            for exchange in [e for e in self.exchanges.running if e.admitted.model == model.name]:
                self.metrics.operator_aborts.labels(model.name).inc()
                exchange.fail(GatewayError(503, f"model {model.name!r} was disabled by an operator",
                                           code="model_disabled"))

    def _apply_judgement(self, judgement: ModelJudgement, startup: bool) -> None:
        """Follow a judgement (its verdicts are already applied to the workers) before the next request is admitted:
        limits, availability, gauges. Called on the event loop."""
        model = self.models[judgement.model.name]
        self.judgements[model.name] = judgement
        self._record_workers(model, judgement, startup)
        self._update_limits(model, judgement)
        self._update_availability(model, judgement, startup)

    def _record_workers(self, model: ServedModel, judgement: ModelJudgement, startup: bool) -> None:
        metrics = self.metrics
        for verdict in judgement.workers:
            worker, info = verdict.worker, verdict.reading.info
            labels = (model.name, worker.url, worker.role)
            if info is not None:
                metrics.worker_pool_tokens.labels(*labels).set(info.identity.pool_tokens)
                metrics.worker_max_req_input_len.labels(*labels).set(info.identity.max_req_input_len)
                if info.context_length is not None:
                    metrics.worker_context_tokens.labels(*labels).set(info.context_length)
            metrics.worker_admitted.labels(*labels).set(1 if worker.verified is not None else 0)
            if startup:
                for warning in verdict.warnings:
                    log.warning("worker %s (model %s): %s", worker.url, model.name, warning)

    def _update_limits(self, model: ServedModel, judgement: ModelJudgement) -> None:
        config, old = model.config, model.admission.limits
        prompt_limit = judgement.effective_limit
        if model.fleet_limit is not None and 0 < model.fleet_limit < prompt_limit:
            prompt_limit = model.fleet_limit  # another replica measured smaller pools: the fleet applies the least
        limits = PromptLimits(
            prompt_tokens=prompt_limit, context_length=config.context_length,
            default_output_tokens=config.default_max_tokens, max_output_tokens=config.max_output_tokens,
            decode_pool_tokens=judgement.decode_pool_tokens)
        if limits == old:
            return
        if judgement.verdict == "clamp" and judgement.effective_limit != old.prompt_tokens:
            log.warning("CLAMPED model %s: %s", model.name, " | ".join(judgement.reasons))
            self.metrics.limit_clamps.labels(model.name).inc()
        model.admission.limits = limits

    def _update_availability(self, model: ServedModel, judgement: ModelJudgement, startup: bool) -> None:
        if startup and not judgement.passes:
            model.refused_at_startup = True
            if self.config.gate.start_anyway:
                log.error("%s\n  (gate.start_anyway: the model answers 503 until its workers pass)",
                          describe_refusal(judgement))
        if model.refused_at_startup and not any(v.pool_mismatch or v.problems for v in judgement.workers):
            model.refused_at_startup = False
        if model.refused_at_startup:
            model.unavailable = "refused by the KV-pool gate: " + _why(judgement)
            model.unavailable_publicly = "refused by the KV-pool gate: " + _public_why(judgement)
        elif not judgement.passes:
            model.unavailable, model.unavailable_publicly = _why(judgement), _public_why(judgement)
        else:
            model.unavailable = model.unavailable_publicly = None
        metrics = self.metrics
        metrics.model_configured_limit.labels(model.name).set(judgement.configured_limit)
        metrics.model_effective_limit.labels(model.name).set(model.admission.limits.prompt_tokens)
        metrics.model_clamped.labels(model.name).set(1 if judgement.verdict == "clamp" else 0)
        metrics.model_available.labels(model.name).set(0 if model.refusal else 1)
        for verdict in ("pass", "warn", "clamp", "refuse"):
            metrics.gate_verdict.labels(model.name, verdict).set(1 if judgement.verdict == verdict else 0)


def _why(judgement: ModelJudgement) -> str:
    """A judgement's reasons with each failing worker's problems, for /readyz and the log."""
    workers = [f"{v.worker.role} {v.worker.url}: {'; '.join(v.problems)}" for v in judgement.workers if v.problems]
    return " | ".join([*judgement.reasons, *workers]) or "see kvgate preflight"


def _public_why(judgement: ModelJudgement) -> str:
    """What is wrong, for a client's 503: how many workers fail and how, never which addresses."""
    short = sum(1 for v in judgement.workers if v.pool_mismatch)
    other = sum(1 for v in judgement.workers if v.problems and not v.pool_mismatch)
    parts = [reason for reason in judgement.reasons if reason.startswith("no usable")]
    if short:
        parts.append(f"{short} worker(s) have a KV pool below the model's advertised limit")
    if other:
        parts.append(f"{other} worker(s) fail the gate's other checks")
    return "; ".join(parts) or "its workers are not verified yet"
