"""A reserve charged to the outage fallback and given back after that outage ended (Redis answered, the fallback was
replaced) must not land in the new fallback: that store never took the charge, so the refund is a gift the tenant
spends in the next outage on top of its share of what Redis says (hostile review of 7f53425)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from routing.state import Budget
from routing.state.resilient import ResilientState


class _FlakyRedis:
    replica = "r1"

    def __init__(self) -> None:
        self.down = False
        self.last_levels: dict[tuple[str, str], tuple[float, int, float]] = {}
        self.level = 100.0

    def _check(self) -> None:
        if self.down:
            raise RedisConnectionError("down")

    async def charge(self, tenant: str, budget: Budget) -> str:
        self._check()
        self.level -= budget.cost
        return "shared"

    async def give_back(self, tenant: str, budget: Budget, ledger: str) -> None:
        self._check()

    async def admit_tenant(self, tenant: str, budgets: Any, max_concurrent: Any, held_here: int = 0,
                           seq: int = 0) -> Any:
        self._check()
        raise AssertionError("not used up")


def _outage_two_admits(refund: bool) -> bool:
    async def scenario() -> bool:
        redis = _FlakyRedis()
        state = ResilientState(redis, on_down="open", retry_s=0.0)  # type: ignore[arg-type]
        out = Budget("output_tokens", 100, 100)
        redis.down = True
        ledger = await state.charge("t", out)
        assert ledger.startswith("local")  # outage 1: the reserve, taken by the fallback
        redis.down = False
        assert await state.charge("t", Budget("output_tokens", 100, 100)) == "shared"  # Redis back: 0 left there
        redis.last_levels[("t", "output_tokens")] = (-50.0, 100, time.monotonic())  # what Redis said last: in debt
        if refund:
            await state.give_back("t", out, ledger)  # outage 1's reserve, unused, given back now
        redis.down = True  # outage 2: this replica may spend its share of what Redis said (nothing)
        decision = await state.admit_tenant("t", [Budget("output_tokens", 100, 50)], None)
        return decision.admitted

    return asyncio.run(scenario())


def test_a_fallback_charge_refunded_within_its_outage_is_given_back() -> None:
    async def scenario() -> bool:
        redis = _FlakyRedis()
        state = ResilientState(redis, on_down="open", retry_s=60.0)  # type: ignore[arg-type]
        redis.last_levels[("t", "output_tokens")] = (50.0, 100, time.monotonic())
        redis.down = True
        ledger = await state.charge("t", Budget("output_tokens", 100, 100))  # outage: 50 → -50 here
        await state.give_back("t", Budget("output_tokens", 100, 100), ledger)  # unused: back to 50
        return (await state.admit_tenant("t", [Budget("output_tokens", 100, 40)], None)).admitted

    assert asyncio.run(scenario())


def test_a_fallback_charge_refunded_after_the_outage_is_no_gift_in_the_next_one() -> None:
    assert not _outage_two_admits(refund=False)  # in debt at Redis: refused in the next outage too
    assert not _outage_two_admits(refund=True), "outage 1's refund was given to outage 2's fallback"
