"""This replica's part in the fleet: the shared state, the tenants it admits, and the sync loop that publishes this
replica's load and limits and follows the fleet's (other replicas' load, kill switches, aborts addressed here)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable

from gateway.config import AuthConfig, StateConfig, TenantConfig
from gateway.errors import model_disabled
from gateway.pd.registry import ExchangeRegistry
from gateway.serving.inflight import Inflight
from gateway.serving.models import ServedModel
from gateway.telemetry.metrics import GatewayMetrics
from gateway.tenancy.limiter import TenantLimiter
from gateway.tenancy.salts import CacheSalts
from gateway.tenancy.tenants import TenantDirectory
from routing.state import FleetReport, FleetState, FleetView, StateUnavailable
from routing.state.memory import MemoryState
from routing.state.redis_state import RedisState, RedisTarget
from routing.state.resilient import ResilientState

log = logging.getLogger("kvgate.fleet")


def make_state(config: StateConfig, metrics: GatewayMetrics) -> FleetState:
    if config.backend == "memory":
        return MemoryState()
    sentinels = tuple((host, int(port)) for host, _, port in (s.rpartition(":") for s in config.redis_sentinels))
    target = RedisTarget(url=config.redis_url, sentinels=sentinels, service=config.redis_service,
                         timeout_s=config.timeout_s)
    metrics.state_up.set(1)
    return ResilientState(RedisState(target, lease_s=config.lease_s), on_down=config.on_redis_down,
                          on_health=lambda up: metrics.state_up.set(1 if up else 0),
                          on_error=lambda operation: metrics.state_errors.labels(operation).inc())


class Fleet:
    def __init__(self, state_config: StateConfig, auth: AuthConfig, tenants: list[TenantConfig],
                 metrics: GatewayMetrics) -> None:
        self.config = state_config
        self.state = make_state(state_config, metrics)
        self.tenants = TenantDirectory(auth, tenants, self.state)
        self.limiter = TenantLimiter(self.state)
        self.salts = CacheSalts(b"")
        self._salt_env = auth.cache_salt_secret_env
        self.closed = False  # the state is down and on_redis_down is closed: requests get 503
        self._task: asyncio.Task[None] | None = None
        self._report: Callable[[], FleetReport] | None = None
        self._apply: Callable[[FleetView], None] | None = None
        self._syncing = asyncio.Lock()  # one sync at a time: the loop's and an operator's never interleave

    def reconfigure_tenants(self, auth: AuthConfig, tenants: list[TenantConfig]) -> None:
        """A reloaded configuration's keys, limits and cache groups, for the next request (the salt's secret stays:
        it is read from the environment once)."""
        self.tenants = TenantDirectory(auth, tenants, self.state)

    @property
    def replica(self) -> str:
        return self.state.replica

    async def start(self, report: Callable[[], FleetReport], apply: Callable[[FleetView], None],
                    abort: Callable[[str], int]) -> None:
        secret = os.environ.get(self._salt_env, "").encode()
        if not secret:
            try:  # every replica must salt a tenant alike, or a tenant's cache hits depend on the replica
                secret = await self.state.shared_secret("cache_salt")
            except Exception as exc:  # Redis down at startup: salts differ per replica until restart (still safe)
                log.warning("no shared cache-salt secret (%s): this replica uses its own; set $%s", exc,
                            self._salt_env)
                secret = os.urandom(32)
        self.salts = CacheSalts(secret)
        self._report, self._apply = report, apply
        self.state.serve_aborts(abort)  # another replica's abort by id is answered here at once
        await self.sync_now()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.state.wait_for_news(self.config.sync_interval_s)
                await self.sync_now()
            except Exception:  # the loop must outlive any one bad sync: kill switches and aborts ride on it
                log.exception("fleet sync failed")
                await asyncio.sleep(self.config.sync_interval_s)

    async def sync_now(self) -> None:
        """Publish this replica's report and follow the fleet's view (also right after an operator's change)."""
        async with self._syncing:
            await self._sync_once()

    async def _sync_once(self) -> None:
        report, apply = self._report, self._apply
        if report is None or apply is None:
            return
        fleet_report = report()
        fleet_report.concurrency, fleet_report.seq = self.limiter.concurrency_report()
        try:
            view = await self.state.sync(fleet_report)
        except StateUnavailable:
            self.closed = True
            return
        except Exception:
            log.exception("fleet sync failed")
            return
        self.closed = False
        apply(view)

    async def stop(self) -> None:
        """After the drain: the loop stops, pending releases are sent, and the replica leaves the fleet."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        await self.limiter.settle(timeout_s=2.0)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.state.leave()
        await self.state.close()


def fleet_report(models: Iterable[ServedModel], inflight: Inflight, *, shared: bool) -> FleetReport:
    """What this replica tells the fleet: its load on each worker, the limits its gate measured, its request ids."""
    models = list(models)
    loads = {w.url: w.in_flight for m in models for w in m.pool.workers}
    limits = {m.name: m.judgement.effective_limit for m in models
              if m.judgement is not None and m.judgement.effective_limit > 0}
    if not shared:  # one replica: no registry to publish
        return FleetReport(loads=loads, limits=limits)
    return FleetReport(loads=loads, limits=limits, requests=inflight.counts())


def follow_fleet(view: FleetView, models: Iterable[ServedModel], exchanges: ExchangeRegistry, inflight: Inflight,
                 metrics: GatewayMetrics) -> None:
    """Other replicas' load on each worker, the lowest measured limit, kill switches, aborts."""
    for model in models:
        for worker in model.pool.workers:
            worker.note_fleet_load(view.loads_elsewhere.get(worker.url, 0))
        model.follow_fleet_limit(view.limits.get(model.name), metrics)
        model.follow_kill_switch(model.name in view.disabled, metrics)
        if view.disabled.get(model.name):  # with cancel_inflight: its requests in flight too
            for exchange in [e for e in exchanges.running if e.admitted.model == model.name]:
                metrics.operator_aborts.labels(model.name).inc()
                exchange.fail(model_disabled(model.name))
    for request_id in view.aborts:
        inflight.abort(request_id)
