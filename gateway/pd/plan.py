"""What one exchange is to do, and under which rules: decided by the serving flow, carried out by `PDExchange`."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

from gateway.admission.admit import AdmittedRequest
from gateway.config import TimeoutsConfig
from gateway.integrity.ttft import TTFTPlausibility
from routing.pools import Lease
from routing.retry_budget import RetryBudget
from routing.workers import Worker

Release = Literal["verified", "immediate"]


@dataclass(frozen=True, slots=True)
class Retries:
    """Other pairs to try when a worker provably never got the request (its connection failed before anything was
    sent): at most `attempts` more, each allowed by the gateway's retry budget."""

    attempts: int
    repick: Callable[[Collection[Worker]], Lease | None]
    budget: RetryBudget

    def next_lease(self, tried: Collection[Worker], made: int) -> Lease | None:
        """Another pair without the workers tried, if attempts and the gateway's retry budget allow."""
        if made >= self.attempts:
            return None
        lease = self.repick(tried)
        if lease is not None and not self.budget.withdraw():
            lease.release()
            return None
        return lease


@dataclass(frozen=True, slots=True)
class ExchangePlan:
    admitted: AdmittedRequest
    timeouts: TimeoutsConfig
    release: Release = "verified"
    retries: Retries | None = None  # None: never moved to another pair
    engine_headers: tuple[tuple[bytes, bytes], ...] = ()  # e.g. the trace context, on both engine requests
    plausibility: TTFTPlausibility | None = None
    cache_salt: str | None = None  # the engines' prefix-cache namespace (SGLang's extra_key): the tenant's
    engine_event_bytes: int = 8 << 20  # the most the gateway reads of one decode event
    engine_answer_bytes: int = 32 << 20  # the most the gateway reads of prefill's answer

    @property
    def release_verified(self) -> bool:
        return self.release == "verified"

    @property
    def waits_for_prefill(self) -> bool:
        """Decode's events are held until prefill has answered: to verify counts, to merge prompt logprobs, or to
        judge the first token's time strictly before any byte is out."""
        strict = self.plausibility is not None and self.plausibility.strict
        return self.release_verified or self.admitted.merge_logprobs or strict
