"""The models the gateway serves: each with its admission and worker pool, following what the KV-pool gate judged of
it (limits, availability) and what the fleet says (the lowest measured limit, the kill switch)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admission.admit import Admission, AdmittedRequest, PromptLimits
from gateway.admission.chat import ChatSettings, with_engine_defaults
from gateway.admission.dialects import Dialect, dialect_for
from gateway.admission.pipeline import build_admission
from gateway.config import GatewayConfig, HealthConfig, ModelConfig, RoutingConfig
from gateway.integrity.ttft import TTFTPlausibility
from gateway.telemetry.metrics import GatewayMetrics
from gateway.template_kwargs import NOT_TEMPLATE_VARIABLES
from routing.breaker import BreakerSpec
from routing.cache_tracking import CacheTracking
from routing.deployment_checks import CheckPolicy
from routing.discovery import DnsSource
from routing.engines.identity import EngineIdentity
from routing.gate import ModelJudgement, safe_limit
from routing.policies import NO_KEY, Policy, RouteKey, make_policy
from routing.pools import ModelPool, pool_for
from routing.prefix_index import PromptTokens
from routing.specs import HealthSpec, ModelSpec, PoolLimits
from routing.stable_hash import stable_hash
from routing.workers import WorkerSpec

log = logging.getLogger("kvgate")

# The dialect assumed for a model none of whose workers has been verified yet (its requests get 503 anyway).
_DEFAULT_DIALECTS = frozenset({Dialect.V0_5_23})


@dataclass(slots=True)
class ServedModel:
    """One model as served: its admission, its worker pool, and what the KV-pool gate and the fleet say of it."""

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
    _template_defaults: tuple[tuple[EngineIdentity | None, ...], str | None] | None = None  # (identities, defaults)
    fleet_limit: int | None = None  # the lowest prompt limit any live replica's gate measured
    cache_tracking: CacheTracking | None = None  # cache_aware: the prefills' cache indexes and KV-event subscribers
    judgement: ModelJudgement | None = None  # the KV-pool gate's latest

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
        identities = tuple(w.verified for w in self.pool.workers)  # per request: cached while they stay the same
        cached = self._template_defaults
        if cached is not None and cached[0] == identities:
            return cached[1]
        found = Counter(identity.rendering.default_chat_template_kwargs for identity in identities
                        if identity is not None)
        defaults = found.most_common(1)[0][0] if found else None
        self._template_defaults = (identities, defaults)
        return defaults

    def route_key(self, admitted: AdmittedRequest, headers: Sequence[tuple[bytes, bytes]], salt: str) -> RouteKey:
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
    def plausibility(self) -> TTFTPlausibility | None:
        rule = self.config.integrity
        if rule.max_prefill_tokens_per_s is None:
            return None
        return TTFTPlausibility(rule.max_prefill_tokens_per_s, rule.min_prompt_tokens, rule.strict)

    @property
    def affinity_header(self) -> bytes | None:
        name = self.config.routing.affinity_header
        return name.encode("latin-1") if name else None

    def dialects(self) -> frozenset[Dialect]:
        """The SGLang dialects of the model's verified workers: a chat is counted once for each."""
        found = frozenset(dialect_for(w.verified.version) for w in self.pool.workers if w.verified is not None)
        return found or _DEFAULT_DIALECTS

    # ── the KV-pool gate's judgement, followed before the next request is admitted ─────────────────────────────
    def follow(self, judgement: ModelJudgement, *, startup: bool, metrics: GatewayMetrics,
               start_anyway: bool) -> None:
        """Limits, availability and gauges from a judgement (its verdicts are already applied to the workers)."""
        self.judgement = judgement
        self._record_workers(judgement, startup, metrics)
        self._update_limits(judgement, metrics)
        self._update_availability(judgement, startup, metrics, start_anyway)

    def follow_fleet_limit(self, fleet_limit: int | None, metrics: GatewayMetrics) -> None:
        """The lowest limit any live replica measured: the fleet applies the least."""
        if fleet_limit == self.fleet_limit:
            return
        self.fleet_limit = fleet_limit
        if self.judgement is not None:
            self._update_limits(self.judgement, metrics)

    def follow_kill_switch(self, disabled: bool, metrics: GatewayMetrics) -> bool:
        """The fleet-wide kill switch; True when it changed."""
        if disabled == self.disabled:
            return False
        self.disabled = disabled
        log.warning("model %s %s fleet-wide by an operator", self.name, "disabled" if disabled else "enabled")
        metrics.model_available.labels(self.name).set(0 if self.refusal else 1)
        return True

    def _record_workers(self, judgement: ModelJudgement, startup: bool, metrics: GatewayMetrics) -> None:
        model = self
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

    def _update_limits(self, judgement: ModelJudgement, metrics: GatewayMetrics) -> None:
        model = self
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
            metrics.limit_clamps.labels(model.name).inc()
        model.admission.limits = limits

    def _update_availability(self, judgement: ModelJudgement, startup: bool, metrics: GatewayMetrics,
                             start_anyway: bool) -> None:
        model = self
        if startup and not judgement.passes:
            model.refused_at_startup = True
            if start_anyway:
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
        metrics.model_configured_limit.labels(model.name).set(judgement.configured_limit)
        metrics.model_effective_limit.labels(model.name).set(model.admission.limits.prompt_tokens)
        metrics.model_clamped.labels(model.name).set(1 if judgement.verdict == "clamp" else 0)
        metrics.model_available.labels(model.name).set(0 if model.refusal else 1)
        for verdict in ("pass", "warn", "clamp", "refuse"):
            metrics.gate_verdict.labels(model.name, verdict).set(1 if judgement.verdict == verdict else 0)


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


def dns_sources(config: GatewayConfig) -> list[DnsSource]:
    return [DnsSource(model.name, role, entry.name, entry.port, entry.bootstrap_port, entry.interval_s, entry.scheme)
            for model in config.models for role in ("prefill", "decode") for entry in model.dns_workers(role)]


def health_spec(health: HealthConfig) -> HealthSpec:
    return HealthSpec(health.interval_s, health.timeout_s, health.failure_threshold, health.success_threshold,
                      health.path)


def make_policies(routing: RoutingConfig) -> tuple[Policy, Policy]:
    """The model's prefill and decode policies; loads older than three polls are not read."""
    max_age_s = 3 * routing.load_poll_s
    return (make_policy(routing.prefill_policy, load_max_age_s=max_age_s),
            make_policy(routing.decode_policy, load_max_age_s=max_age_s))


def build_model(config: ModelConfig, *, cache_bytes: int) -> ServedModel:
    """Load the tokenizer and chat template (slow: call off the event loop) and lay out the worker pool."""
    spec = model_spec(config)
    prefill_policy, decode_policy = make_policies(config.routing)
    pool = pool_for(spec, prefill_policy=prefill_policy, decode_policy=decode_policy)
    return ServedModel(config, spec, build_admission(config, cache_bytes=cache_bytes), pool)


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


def describe_refusal(judgement: ModelJudgement) -> str:
    """One block: the model, each failing worker once (with its pool and safe limit), and the ways out."""
    model = judgement.model
    lines = [f"model {model.name!r} refused by the KV-pool gate (advertised limit {judgement.configured_limit} "
             f"prompt tokens, on_pool_mismatch: {model.on_pool_mismatch}):"]
    for verdict in judgement.workers:
        if verdict.problems:
            lines.append(f"  {verdict.worker.role:7s} {verdict.worker.url}: {'; '.join(verdict.problems)}")
    lines.extend(f"  {line}" for line in ways_out(judgement))
    return "\n".join(lines)


def ways_out(judgement: ModelJudgement) -> list[str]:
    safe = safe_limit(judgement)
    if safe is None or judgement.model.on_pool_mismatch == "clamp":
        return []
    return [f"ways out: set max_prompt_tokens: {safe} (or lower) for this model, or on_pool_mismatch: clamp to "
            f"serve it at {safe} prompt tokens"]
