"""What a Redis outage means: `open` carries on with this replica's own state (its share of each tenant's limits,
local load, the kill switches last seen), `closed` refuses (the caller answers 503). Either way no call waits longer
than the Redis timeout, an outage is logged once and metered, and the shared state is used again as soon as Redis
answers.

Open, each replica takes its share of a tenant's limits (split among the live replicas it last saw: the shares add
up to the limit): concurrency counts every request the replica already holds, Redis-admitted ones included, and a
budget starts from its share of what the shared bucket last held here and refills at its share's rate."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

from redis.exceptions import RedisError

from routing.state.base import Budget, FleetReport, FleetView, Ledger, StateUnavailable, TenantDecision
from routing.state.memory import MemoryState
from routing.state.redis_state import RedisState
from routing.state.shares import seeded_level, share

log = logging.getLogger("kvgate.state")

T = TypeVar("T")
OnDown = Literal["open", "closed"]
_FAILURES = (RedisError, OSError, TimeoutError)


class ResilientState:
    shared = True

    def __init__(self, primary: RedisState, *, on_down: OnDown, retry_s: float = 1.0,
                 on_health: Callable[[bool], None] = lambda up: None,
                 on_error: Callable[[str], None] = lambda operation: None) -> None:
        self.primary = primary
        self.fallback = self._new_fallback()
        self._outages = 0  # the fallback's generation: a charge it took is given back to it, never to the next one
        self.replica = primary.replica
        self.on_down = on_down
        self._retry_s = retry_s
        self._down_since: float | None = None
        self._next_try = 0.0
        self._on_health = on_health
        self._on_error = on_error
        self._last_view: FleetView | None = None

    def _new_fallback(self) -> MemoryState:
        return MemoryState(replica=self.primary.replica, seed=self._seed)

    def _seed(self, tenant: str, budget: Budget, now: float) -> float | None:
        """A fallback bucket (of this replica's share) starts from its share of what Redis last said was left."""
        last = self.primary.last_levels.get((tenant, budget.kind))
        if last is None or last[1] <= 0:
            return None  # never seen here: its whole share
        level, per_min, at = last
        return seeded_level(level, at, per_min, budget.per_min, now)

    def _share(self, limit: int) -> int:
        view = self._last_view
        return share(limit, view.replicas if view is not None else (), self.replica)

    @property
    def up(self) -> bool:
        return self._down_since is None

    async def _call(self, operation: str, primary: Callable[[], Awaitable[T]],
                    fallback: Callable[[], Awaitable[T]]) -> T:
        if self._down_since is not None and time.monotonic() < self._next_try:
            return await self._without_redis(fallback)
        try:
            result = await primary()
        except _FAILURES as exc:
            self._on_error(operation)
            self._mark_down(exc)
            return await self._without_redis(fallback)
        self._mark_up()
        return result

    async def _without_redis(self, fallback: Callable[[], Awaitable[T]]) -> T:
        if self.on_down == "closed":
            raise StateUnavailable("the shared state (Redis) is unreachable and state.on_redis_down is closed")
        return await fallback()

    def _mark_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        self._next_try = now + self._retry_s
        if self._down_since is None:
            self._down_since = now
            log.error("shared state (Redis) unreachable: %s — failing %s until it answers", exc or type(exc).__name__,
                      "open (this replica's own limits and load)" if self.on_down == "open" else "closed (503)")
            self._on_health(False)

    def _mark_up(self) -> None:
        if self._down_since is not None:
            log.warning("shared state (Redis) answers again after %.1fs", time.monotonic() - self._down_since)
            self._down_since = None
            self.fallback = self._new_fallback()  # the next outage starts from what Redis says then
            self._outages += 1
            self._on_health(True)

    async def admit_tenant(self, tenant: str, budgets: Sequence[Budget], max_concurrent: int | None,
                           held_here: int = 0, seq: int = 0) -> TenantDecision:
        return await self._call("admit", lambda: self.primary.admit_tenant(tenant, budgets, max_concurrent,
                                                                           held_here, seq),
                                lambda: self._admit_alone(tenant, budgets, max_concurrent, held_here))

    async def _admit_alone(self, tenant: str, budgets: Sequence[Budget], max_concurrent: int | None,
                           held_here: int) -> TenantDecision:
        """This replica's share of each limit, with what it already holds counted (its own count, not the
        fallback's: requests admitted through Redis before the outage hold their slots too)."""
        shared = [Budget(b.kind, self._share(b.per_min), b.cost) for b in budgets]
        for budget in shared:
            if budget.per_min <= 0:  # no share of this budget for this replica while the fleet is apart
                return TenantDecision(False, self._retry_s, budget.kind)
        cap = None if max_concurrent is None else self._share(max_concurrent)
        return await self.fallback.admit_tenant(tenant, shared, cap, held_here)

    async def release_tenant(self, tenant: str, held_here: int = 0, seq: int = 0) -> None:
        # A slot may have been taken from the fallback during an outage: given back there too (floored at zero).
        await self.fallback.release_tenant(tenant)
        await self._call("release", lambda: self.primary.release_tenant(tenant, held_here, seq), _nothing)

    async def charge(self, tenant: str, budget: Budget) -> Ledger:
        async def alone() -> Ledger:
            await self.fallback.charge(tenant, self._shared_out(budget))
            return self._local_ledger()

        return await self._call("charge", lambda: self.primary.charge(tenant, budget), alone)

    def _local_ledger(self) -> Ledger:
        return f"local@{self._outages}"

    async def give_back(self, tenant: str, budget: Budget, ledger: Ledger) -> None:
        if ledger.startswith("local"):  # taken by an outage's fallback: given back there, whether Redis is back or
            # not, unless that fallback was replaced since (Redis answered): the new one never took it, a gift
            if ledger == self._local_ledger():
                await self.fallback.give_back(tenant, self._shared_out(budget), "local")
            return
        try:  # taken by Redis: given back to Redis or not at all (to the fallback it would be a gift)
            await self.primary.give_back(tenant, budget, "shared")
        except _FAILURES as exc:
            self._on_error("give_back")
            self._mark_down(exc)

    def _shared_out(self, budget: Budget) -> Budget:
        """The budget as this replica's share of it (what the fallback holds in an outage)."""
        return Budget(budget.kind, max(1, self._share(budget.per_min)), budget.cost)

    async def sync(self, report: FleetReport) -> FleetView:
        async def remembered() -> FleetView:
            view = await self.primary.sync(report)
            self._last_view = view
            return view

        async def local() -> FleetView:
            # Open: no other replica's load (it would go stale), but the kill switches last seen still hold.
            view = await self.fallback.sync(report)
            last = self._last_view
            return view if last is None else FleetView(view.loads_elsewhere, view.limits,
                                                       {**last.disabled, **view.disabled}, view.aborts,
                                                       last.replicas)

        # The sync is the probe that finds Redis back: it always tries, whatever the backoff says.
        self._next_try = 0.0
        return await self._call("sync", remembered, local)

    async def set_disabled(self, model: str, disabled: bool, *, cancel_inflight: bool = False) -> None:
        await _for_operator(self.primary.set_disabled(model, disabled, cancel_inflight=cancel_inflight))

    async def register_request(self, request_id: str) -> None:
        await self.primary.register_request(request_id)  # batched into the next sync: never fails here

    async def unregister_request(self, request_id: str) -> None:
        await self.primary.unregister_request(request_id)

    async def request_abort(self, request_id: str) -> list[str]:
        return await _for_operator(self.primary.request_abort(request_id))

    def serve_aborts(self, abort: Callable[[str], int]) -> None:
        self.primary.serve_aborts(abort)

    async def api_key_tenant(self, key_hash: str) -> str | None:
        async def unknown() -> str | None:
            raise StateUnavailable("the shared state (Redis) is unreachable")

        # Open or closed, a key only Redis knows cannot be judged without it (the caller decides).
        return await self._call("api_key", lambda: self.primary.api_key_tenant(key_hash), unknown)

    async def shared_secret(self, name: str) -> bytes:
        return await self.primary.shared_secret(name)

    async def wait_for_news(self, timeout_s: float) -> None:
        await self.primary.wait_for_news(timeout_s)

    async def leave(self) -> None:
        await self._call("leave", self.primary.leave, _nothing)

    async def close(self) -> None:
        await self.primary.close()


async def _for_operator(call: Awaitable[T]) -> T:
    """An operator's own change or question: never answered from a fallback, its failure told in Redis's words."""
    try:
        return await call
    except _FAILURES as exc:
        raise StateUnavailable(f"the shared state (Redis) did not answer: {exc or type(exc).__name__}") from exc


async def _nothing() -> None:
    return None
