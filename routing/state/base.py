"""What the shared state offers, whatever holds it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

BudgetKind = Literal["requests", "prompt_tokens", "output_tokens", "body_bytes"]
# Which store took a charge: the shared one (Redis), or this replica's own (memory, or the fallback in an outage:
# "local@<n>", the n-th outage's fallback, which the next outage replaces). Compared for equality only.
Ledger = str


class StateUnavailable(Exception):
    """The shared store cannot be reached (and the gateway is configured to fail closed)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """One per-minute rate limit of a tenant, as a token bucket that holds `per_min` and refills `per_min` a minute.

    A request is admitted while the bucket holds at least one unit and is then charged in full, so the bucket may go
    below zero: over any window a tenant gets at most its limit plus one request's worth (a request is never refused
    for being larger than the bucket, which would refuse it forever)."""

    kind: BudgetKind
    per_min: int
    cost: int  # charged on admission; 0 only checks the bucket is not in debt (output tokens, charged later)


@dataclass(frozen=True, slots=True)
class TenantDecision:
    admitted: bool
    retry_after_s: float = 0.0
    reason: str = ""  # which limit refused: a Budget kind or "max_concurrent"


@dataclass(slots=True)
class FleetReport:
    """What one replica tells the others on each sync."""

    loads: dict[str, int] = field(default_factory=dict)  # worker URL → requests this replica has in flight there
    limits: dict[str, int] = field(default_factory=dict)  # model → prompt-token limit this replica's gate measured
    concurrency: dict[str, int] = field(default_factory=dict)  # tenant → its requests in flight here
    requests: dict[str, int] = field(default_factory=dict)  # request id → its exchanges in flight here
    seq: int = 0  # when `concurrency` was read (the limiter's stamp): an older count arriving later is ignored


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the other live replicas said, and the fleet-wide switches."""

    loads_elsewhere: dict[str, int]  # worker URL → requests other live replicas have in flight there
    limits: dict[str, int]  # model → the lowest limit any live replica measured (its own included)
    disabled: dict[str, bool]  # model → disabled fleet-wide; True: also cancel requests in flight
    aborts: tuple[str, ...]  # request ids some replica asked this one to abort
    replicas: tuple[str, ...] = ()  # the live replicas (this one included): what a Redis outage shares limits by


class FleetState(Protocol):
    replica: str  # this process's id in the fleet

    async def admit_tenant(self, tenant: str, budgets: Sequence[Budget], max_concurrent: int | None,
                           held_here: int = 0, seq: int = 0) -> TenantDecision:
        """Check every budget and the concurrency cap atomically; charge them all (and take a slot) or none.
        `held_here`: the tenant's other requests this replica holds or is admitting (its share is set, never
        incremented, so a count can never be applied twice); `seq`: when that count was read (increasing per
        replica): a count older than one already applied is not applied (writes may arrive out of order)."""
        ...

    async def release_tenant(self, tenant: str, held_here: int = 0, seq: int = 0) -> None:
        """Give back the concurrency slot an admitted request took; `held_here` is what this replica still holds,
        read at `seq`."""
        ...

    async def charge(self, tenant: str, budget: Budget) -> Ledger:
        """Charge a budget unconditionally (output tokens, as they are produced); says which store took it."""
        ...

    async def give_back(self, tenant: str, budget: Budget, ledger: Ledger) -> None:
        """Return `budget.cost` of an earlier charge to the store that took it (`ledger`), never to another: a
        bucket never fills beyond its size. Dropped when that store cannot take it now (the tenant gains nothing)."""
        ...

    async def sync(self, report: FleetReport) -> FleetView:
        """Renew this replica's leases, publish its report, and read the fleet's."""
        ...

    async def set_disabled(self, model: str, disabled: bool, *, cancel_inflight: bool = False) -> None: ...

    async def register_request(self, request_id: str) -> None: ...

    async def unregister_request(self, request_id: str) -> None: ...

    async def request_abort(self, request_id: str) -> list[str]:
        """Ask every other live replica that has `request_id` in flight to abort it, at once; their ids (none:
        nobody else has it — the asking replica aborts its own requests itself)."""
        ...

    def serve_aborts(self, abort: Callable[[str], int]) -> None:
        """How this replica aborts a request by id when another asks (`abort` says how many it had)."""
        ...

    async def api_key_tenant(self, key_hash: str) -> str | None:
        """The tenant an API key (its sha256 hex) belongs to, for keys defined in the store rather than YAML."""
        ...

    async def shared_secret(self, name: str) -> bytes:
        """A random secret every replica agrees on, created by the first to ask."""
        ...

    async def wait_for_news(self, timeout_s: float) -> None:
        """Return when another replica published something (a kill switch, an abort) or after `timeout_s`."""
        ...

    async def leave(self) -> None:
        """This replica stops: its lease, load, slots and registry stop counting now (not when the lease lapses)."""
        ...

    async def close(self) -> None: ...

    @property
    def shared(self) -> bool:
        """Whether other replicas see this state."""
        ...
