"""Per-tenant limits, enforced through the shared state so that every replica counts against one budget."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

from gateway.tenancy.errors import RateLimited, StateDown
from gateway.tenancy.tenants import Tenant
from routing.state import Budget, FleetState, Ledger, StateUnavailable

T = TypeVar("T")


class TenantPass:
    """An admitted request's hold on its tenant: the concurrency slot (given back once) and its output charge."""

    def __init__(self, limiter: TenantLimiter, tenant: Tenant) -> None:
        self._limiter = limiter
        self.tenant = tenant
        self._released = False
        self._charged = 0  # output tokens charged so far
        self._charges: list[asyncio.Task[Ledger | None]] = []  # on their way: each says which store took it

    @property
    def charges_output(self) -> bool:
        return bool(self.tenant.limits.output_tokens_per_min)

    def output_so_far(self, tokens: int) -> None:
        """Charge the output produced since the last call (while the request streams)."""
        if tokens > self._charged:
            charge = self._limiter.charge_output(self.tenant, tokens - self._charged)
            if charge is not None:
                self._charges.append(charge)
            self._charged = tokens

    def release(self, output_tokens: int = 0) -> None:
        """Given back, the output charged at last what it was: a charge made beyond it (a whole answer's most,
        charged up front) is refunded, to the store that took it."""
        if self._released:
            return
        self._released = True
        if self.charges_output:
            if output_tokens >= self._charged:
                self.output_so_far(output_tokens)
            else:
                self._limiter.give_back_output(self.tenant, self._charged - output_tokens, self._charges)
        self._charges = []
        self._limiter.finished(self.tenant)


class TenantLimiter:
    def __init__(self, state: FleetState) -> None:
        self._state = state
        self.in_flight: Counter[str] = Counter()  # tenant → its requests in flight on this replica (max_concurrent)
        # tenant → (until when, why): a budget that refused is known empty until then, so a throttled tenant's next
        # requests are refused before their bodies are read and counted (no refill can come sooner).
        self._empty_until: dict[str, tuple[float, str]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # Each count of in_flight sent to the shared state is stamped when read: the state applies the newest it
        # has seen, whatever order the writes arrive in.
        self._stamps = itertools.count(1)

    def check(self, tenant: Tenant) -> None:
        """Refuse at once (429) while one of the tenant's budgets is known to be empty."""
        held = self._empty_until.get(tenant.name)
        if held is not None:
            wait = held[0] - time.monotonic()
            if wait > 0:
                raise RateLimited(tenant.name, held[1], wait)
            del self._empty_until[tenant.name]

    async def charge_request(self, tenant: Tenant, body_bytes: int) -> None:
        """Every request that reached its body costs its tenant one request and its body's bytes, whatever its answer
        will be (400 and 413 included), before the body is parsed; raises 429 when a budget is empty."""
        limits = tenant.limits
        budgets = []
        if limits.requests_per_min:
            budgets.append(Budget("requests", limits.requests_per_min, 1))
        if limits.body_bytes_per_min:
            budgets.append(Budget("body_bytes", limits.body_bytes_per_min, body_bytes))
        if not budgets:
            return
        try:
            decision = await self._state.admit_tenant(tenant.name, budgets, None, 0)
            if not decision.admitted:  # refused, and still charged: its body was read all the same
                for budget in budgets:
                    await self._state.charge(tenant.name, budget)
        except StateUnavailable:
            raise StateDown() from None
        if not decision.admitted:
            # The wait grows by what was just charged to the budget that refused.
            added = max((b.cost * 60 / b.per_min for b in budgets if b.kind == decision.reason), default=0.0)
            self._refused(tenant, decision.reason, decision.retry_after_s + added)

    def _refused(self, tenant: Tenant, reason: str, retry_after_s: float) -> NoReturn:
        if reason != "max_concurrent":  # a slot may free any moment; an empty budget refills slowly
            if len(self._empty_until) > 100_000:
                self._empty_until.clear()
            self._empty_until[tenant.name] = (time.monotonic() + retry_after_s, reason)
        raise RateLimited(tenant.name, reason, retry_after_s)

    async def admit(self, tenant: Tenant, prompt_tokens: int) -> TenantPass:
        """Take the request's concurrency slot and charge its prompt, or raise 429 (with when to retry). Its request
        and body were charged already (`charge_request`)."""
        limits = tenant.limits
        if not tenant.limited:
            return TenantPass(self, tenant)
        budgets = []
        if limits.prompt_tokens_per_min:
            budgets.append(Budget("prompt_tokens", limits.prompt_tokens_per_min, prompt_tokens))
        if limits.output_tokens_per_min:
            budgets.append(Budget("output_tokens", limits.output_tokens_per_min, 0))
        # Counted here before the shared state is asked: a sync taken meanwhile must not report (and so make true)
        # a count without this request. Undone below if it is not admitted.
        held_here = self.in_flight[tenant.name]  # this replica's others, admitted or being admitted
        if limits.max_concurrent is not None:
            self.in_flight[tenant.name] += 1
        try:
            decision = await self._state.admit_tenant(tenant.name, budgets, limits.max_concurrent, held_here,
                                                      next(self._stamps))
        except BaseException as exc:
            self._forget_slot(tenant)
            if isinstance(exc, StateUnavailable):
                raise StateDown() from None
            raise
        if not decision.admitted:
            self._forget_slot(tenant)
            self._refused(tenant, decision.reason, decision.retry_after_s)
        return TenantPass(self, tenant)

    def _forget_slot(self, tenant: Tenant) -> None:
        if tenant.limits.max_concurrent is not None:
            self.in_flight[tenant.name] -= 1
            if self.in_flight[tenant.name] <= 0:
                del self.in_flight[tenant.name]

    def finished(self, tenant: Tenant) -> None:
        if tenant.limits.max_concurrent is not None:
            self._forget_slot(tenant)
            self._spawn(self._state.release_tenant(tenant.name, self.in_flight.get(tenant.name, 0),
                                                   next(self._stamps)))

    def charge_output(self, tenant: Tenant, tokens: int) -> asyncio.Task[Ledger | None] | None:
        """Charge `tokens` of output; the task says which store took it (None: none did)."""
        per_min = tenant.limits.output_tokens_per_min
        if per_min and tokens > 0:
            return self._spawn(self._state.charge(tenant.name, Budget("output_tokens", per_min, tokens)))
        return None

    def give_back_output(self, tenant: Tenant, tokens: int, charges: list[asyncio.Task[Ledger | None]]) -> None:
        """Return `tokens` of output charged by `charges` (the last first), each part to the store that took it."""
        per_min = tenant.limits.output_tokens_per_min
        if per_min and tokens > 0 and charges:
            self._spawn(self._give_back(tenant.name, per_min, tokens, list(charges)))

    async def _give_back(self, tenant: str, per_min: int, tokens: int,
                         charges: list[asyncio.Task[Ledger | None]]) -> None:
        ledgers = [await charge for charge in charges]  # each charge's task never raises (_quietly)
        ledger = next((ledger for ledger in reversed(ledgers) if ledger is not None), None)
        if ledger is not None and len(set(ledgers)) == 1:  # an outage began or ended between them: nothing back
            await self._state.give_back(tenant, Budget("output_tokens", per_min, tokens), ledger)

    def concurrency_report(self) -> tuple[dict[str, int], int]:
        """This replica's count per tenant, which every sync makes the shared state's truth for this replica (a
        release or an admit whose answer was lost is corrected there), and its stamp."""
        return dict(self.in_flight), next(self._stamps)

    async def settle(self, timeout_s: float) -> None:
        """Wait (a little) for releases and charges still on their way to the shared state."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    def _spawn(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T | None]:
        task = asyncio.get_running_loop().create_task(_quietly(coroutine))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _quietly(coroutine: Coroutine[Any, Any, T]) -> T | None:
    try:
        return await coroutine
    except StateUnavailable:
        return None  # closed and Redis down: the next sync re-asserts this replica's counts
