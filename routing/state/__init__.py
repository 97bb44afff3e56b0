"""State several gateway replicas share: tenants' budgets and concurrency, fleet-wide load, the kill switch, the
request registry for cross-replica aborts, and the gate's limits. `memory` keeps it in this process (one replica),
`redis` in a Redis every replica reaches; `resilient` decides what happens when that Redis is down."""

from routing.state.base import Budget, FleetReport, FleetState, FleetView, Ledger, StateUnavailable, TenantDecision

__all__ = ["Budget", "FleetReport", "FleetState", "FleetView", "Ledger", "StateUnavailable", "TenantDecision"]
