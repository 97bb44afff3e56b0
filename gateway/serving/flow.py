"""One request from admission to dispatch: count and check it, take the tenant's pass, route it, wait in the queue
for a worker pair, and start its exchange. Every hold taken on the way (the queue slot, the tenant pass, the lease)
is given back by the `with` that took it unless the exchange took it over: no path releases anything by hand."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Protocol

from gateway.admission.admit import AdmittedRequest
from gateway.admission.offload import AdmissionWorkers, ModelState
from gateway.admission.pipeline import admit_body, resolve_model
from gateway.admission.requests import Route
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, aborted_by_operator, model_unavailable
from gateway.integrity.provenance import ProvenanceChecker
from gateway.pd.exchange import PDExchange
from gateway.pd.plan import ExchangePlan, Retries
from gateway.pd.registry import ExchangeRegistry
from gateway.serving.inflight import Inflight
from gateway.serving.models import ServedModel
from gateway.telemetry.record import RequestRecord
from gateway.tenancy.limiter import TenantLimiter
from gateway.tenancy.salts import CacheSalts
from gateway.tenancy.tenants import Tenant
from routing.engines.client import EngineClient
from routing.policies import RouteKey
from routing.pools import Lease, NoWorkerAvailable, PoolSaturated
from routing.retry_budget import RetryBudget
from routing.workers import Worker


class ReceivedBody(Protocol):
    """A client's body as the HTTP edge received it: in memory when small, else spooled to the file at `path`."""

    @property
    def in_memory(self) -> bytes | None: ...
    @property
    def path(self) -> str | None: ...


@dataclass(slots=True)
class Flow:
    """What admission and dispatch need of the running gateway."""

    config: GatewayConfig
    models: dict[str, ServedModel]
    admission_workers: AdmissionWorkers
    engines: EngineClient
    exchanges: ExchangeRegistry
    inflight: Inflight
    retry_budget: RetryBudget

    def model_for(self, name: str | None) -> ServedModel:
        return resolve_model(name, self.models, lambda model: model.refusal)

    async def admit(self, route: Route, body: ReceivedBody, *, tenant: Tenant) -> tuple[ServedModel, AdmittedRequest]:
        """Count and check a body: on the event loop when it is small, in an admission worker when it is large."""
        raw = body.in_memory
        if raw is not None:
            admitted = await admit_body(route, raw, tenant=tenant.name, find_model=self.model_for)
        else:
            assert body.path is not None  # a body is in memory or spooled to its file
            state = {m.name: ModelState(m.admission.limits, m.dialects(), m.refusal, m.engine_template_defaults())
                     for m in self.models.values()}
            admitted = await self.admission_workers.admit(route, body.path, tenant=tenant.name,
                                                          line=tenant.admission_line, state=state)
        return self.models[admitted.model], admitted

    async def run(self, route: Route, body: ReceivedBody, tenant: Tenant, limiter: TenantLimiter, salts: CacheSalts,
                  headers: Sequence[tuple[bytes, bytes]], record: RequestRecord, *, sample: bool) -> PDExchange:
        """Admit the request and dispatch it; raises the GatewayError to answer instead (nothing was sent)."""
        # Abortable by its id from the start: an abort while its body is still being counted refuses it after.
        with self.inflight.queued(record.request_id) as waiting:
            started = time.perf_counter()
            model, admitted = await self.admit(route, body, tenant=tenant)
            record.model = model.name
            record.admitted = admitted
            record.sampled = sample and ProvenanceChecker.samples(model.config.integrity.provenance_sample)
            record.admission_s = time.perf_counter() - started
            if waiting.aborted:
                raise aborted_by_operator()
            tenant_pass = await limiter.admit(tenant, admitted.most_prompt_tokens)
            with ExitStack() as held:  # what is still ours: popped once the exchange owns it
                held.callback(tenant_pass.release)
                salt = salts.salt(tenant.salt_group, admitted.cache_salt)
                key = model.route_key(admitted, headers, salt)
                started = time.perf_counter()
                lease = await _acquire(model, key)
                record.queue_s = time.perf_counter() - started
                held.callback(lease.release)
                if waiting.aborted:
                    raise aborted_by_operator()
                if model.refusal is not None:  # disabled (or refused by the gate) while it waited in the queue
                    raise model_unavailable(model.name, model.refusal, detail=model.unavailable)
                plan = self._plan(model, admitted, key, record, salt)
                exchange = PDExchange(self.engines, lease, plan, self.exchanges, tenant_pass=tenant_pass)
                self.inflight.dispatched(record.request_id, exchange)  # registered since queued; forgotten at close
                waiting.handed_over()
                held.pop_all()
        exchange.start()
        return exchange

    def _plan(self, model: ServedModel, admitted: AdmittedRequest, key: RouteKey, record: RequestRecord,
              salt: str) -> ExchangePlan:
        def repick(tried: Collection[Worker]) -> Lease | None:
            try:
                return model.pool.pick_pair(key, exclude=tried)
            except (NoWorkerAvailable, PoolSaturated):
                return None

        self.retry_budget.deposit()
        return ExchangePlan(admitted, timeouts=self.config.timeouts, release=model.config.release,
                            retries=Retries(model.config.routing.retries, repick, self.retry_budget),
                            engine_headers=engine_headers(record.engine_traceparent, record.request_id),
                            plausibility=model.plausibility, cache_salt=salt,
                            engine_event_bytes=model.config.limits.engine_event_bytes,
                            engine_answer_bytes=model.config.limits.engine_answer_bytes)


async def _acquire(model: ServedModel, key: RouteKey) -> Lease:
    try:
        return await model.pool.acquire_pair(key)
    except NoWorkerAvailable as exc:
        raise GatewayError(503, exc.public_message, code="no_worker_available", detail=str(exc)) from None
    except PoolSaturated as exc:
        error = GatewayError(503, str(exc), code="overloaded")
        error.retry_after_s = exc.retry_after_s
        raise error from None


def engine_headers(traceparent: str | None, request_id: str | None) -> tuple[tuple[bytes, bytes], ...]:
    """What both engine requests carry besides the body: the trace context and the client's request id."""
    headers = []
    if traceparent:
        headers.append((b"traceparent", traceparent.encode()))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    return tuple(headers)
