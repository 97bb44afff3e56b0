"""The state of one replica, in its own memory: the default, and what `on_redis_down: open` falls back to."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence

from routing.state.base import Budget, FleetReport, FleetView, Ledger, TenantDecision
from routing.state.buckets import Bucket, empty, wait_s


class MemoryState:
    shared = False

    def __init__(self, *, replica: str | None = None, clock: Callable[[], float] = time.monotonic,
                 seed: Callable[[str, Budget, float], float | None] = lambda tenant, budget, now: None) -> None:
        self.replica = replica or uuid.uuid4().hex[:12]
        self._clock = clock
        self._seed = seed  # a new bucket's level (None: full); a fallback starts from what Redis last said
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self._concurrent: Counter[str] = Counter()
        self._disabled: dict[str, bool] = {}
        self._requests: Counter[str] = Counter()
        self._secrets: dict[str, bytes] = {}
        self._news = asyncio.Event()

    async def admit_tenant(self, tenant: str, budgets: Sequence[Budget], max_concurrent: int | None,
                           held_here: int = 0, seq: int = 0) -> TenantDecision:
        now = self._clock()
        # Alone, its own count is the truth; as a Redis fallback, the replica's (held_here) also counts requests
        # admitted through Redis before the outage.
        if max_concurrent is not None and max(self._concurrent[tenant], held_here) >= max_concurrent:
            return TenantDecision(False, 1.0, "max_concurrent")
        buckets = [(budget, self._bucket(tenant, budget, now)) for budget in budgets]
        refused = [(wait_s(level, budget.per_min), budget.kind) for budget, level in
                   ((b, bucket.refill(b.per_min, now)) for b, bucket in buckets) if empty(level)]
        if refused:
            wait, kind = max(refused)
            return TenantDecision(False, wait, kind)
        for budget, bucket in buckets:
            bucket.level -= budget.cost
        if max_concurrent is not None:
            self._concurrent[tenant] += 1
        return TenantDecision(True)

    async def release_tenant(self, tenant: str, held_here: int = 0, seq: int = 0) -> None:
        if self._concurrent[tenant] > 0:
            self._concurrent[tenant] -= 1
        if not self._concurrent[tenant]:
            del self._concurrent[tenant]

    async def charge(self, tenant: str, budget: Budget) -> Ledger:
        now = self._clock()
        bucket = self._bucket(tenant, budget, now)
        bucket.refill(budget.per_min, now)
        bucket.level -= budget.cost
        return "local"

    async def give_back(self, tenant: str, budget: Budget, ledger: Ledger) -> None:
        if ledger == "local":
            now = self._clock()
            bucket = self._bucket(tenant, budget, now)
            bucket.level = min(float(budget.per_min), bucket.refill(budget.per_min, now) + budget.cost)

    def _bucket(self, tenant: str, budget: Budget, now: float) -> Bucket:
        key = (tenant, budget.kind)
        bucket = self._buckets.get(key)
        if bucket is None:
            seeded = self._seed(tenant, budget, now)
            bucket = self._buckets[key] = Bucket(float(budget.per_min) if seeded is None else seeded, now)
        return bucket

    async def sync(self, report: FleetReport) -> FleetView:
        self._forget_full_buckets()
        return FleetView(loads_elsewhere={}, limits=dict(report.limits), disabled=dict(self._disabled), aborts=(),
                         replicas=(self.replica,))

    def _forget_full_buckets(self) -> None:
        """A bucket left alone for a minute is full again, as if it had never been used."""
        stale = self._clock() - 60.0
        for key in [key for key, bucket in self._buckets.items() if bucket.at < stale and bucket.level >= 0]:
            del self._buckets[key]

    async def set_disabled(self, model: str, disabled: bool, *, cancel_inflight: bool = False) -> None:
        if disabled:
            self._disabled[model] = cancel_inflight
        else:
            self._disabled.pop(model, None)
        self._news.set()

    async def register_request(self, request_id: str) -> None:
        self._requests[request_id] += 1

    async def unregister_request(self, request_id: str) -> None:
        self._requests[request_id] -= 1
        if self._requests[request_id] <= 0:
            del self._requests[request_id]

    async def request_abort(self, request_id: str) -> list[str]:
        return []  # no other replica: the caller aborts its own requests itself

    def serve_aborts(self, abort: Callable[[str], int]) -> None:
        pass  # nobody else asks

    async def api_key_tenant(self, key_hash: str) -> str | None:
        return None

    async def shared_secret(self, name: str) -> bytes:
        return self._secrets.setdefault(name, secrets.token_bytes(32))

    async def wait_for_news(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._news.wait(), timeout_s)
        except TimeoutError:
            pass
        self._news.clear()

    async def leave(self) -> None:
        pass

    async def close(self) -> None:
        pass
