"""This replica's requests by their x-request-id: those waiting for a worker pair and those dispatched, so that an
operator's abort reaches both, and the fleet's registry of them (where replicas share state)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from gateway.errors import aborted_by_operator
from gateway.pd.exchange import PDExchange
from gateway.telemetry.metrics import GatewayMetrics
from routing.state import FleetState


class Waiting:
    """One request's turn in the queue; `handed_over()` once its exchange carries the id."""

    __slots__ = ("_inflight", "dispatched", "request_id")

    def __init__(self, inflight: Inflight, request_id: str) -> None:
        self._inflight = inflight
        self.request_id = request_id
        self.dispatched = False

    @property
    def aborted(self) -> bool:
        """An operator aborted it while it waited: it must not be dispatched."""
        return self.request_id in self._inflight._abort_queued

    def handed_over(self) -> None:
        self.dispatched = True


class Inflight:
    def __init__(self, state: FleetState, metrics: GatewayMetrics) -> None:
        self._state = state
        self._metrics = metrics
        self._by_request_id: dict[str, set[PDExchange]] = {}
        self._queued: Counter[str] = Counter()  # request ids waiting for a worker pair (admitted, not dispatched)
        self._abort_queued: set[str] = set()  # ... of which an operator aborted these: refused when their turn comes
        self._state_calls: set[asyncio.Task[None]] = set()

    @contextmanager
    def queued(self, request_id: str) -> Iterator[Waiting]:
        """While a request waits for a worker pair it is abortable by its id, fleet-wide. One that leaves without
        being dispatched leaves the fleet's registry here; a dispatched one when its exchange closes."""
        self._queued[request_id] += 1
        if self._state.shared:  # one replica: the local maps are the whole registry
            self._spawn_state_call(self._state.register_request(request_id))
        waiting = Waiting(self, request_id)
        try:
            yield waiting
        finally:
            self._queued[request_id] -= 1
            if self._queued[request_id] <= 0:
                del self._queued[request_id]
                self._abort_queued.discard(request_id)
            if not waiting.dispatched and self._state.shared:
                self._spawn_state_call(self._state.unregister_request(request_id))

    def dispatched(self, request_id: str, exchange: PDExchange) -> None:
        exchange.request_id = request_id
        self._by_request_id.setdefault(request_id, set()).add(exchange)

    def closed(self, exchange: PDExchange) -> None:
        request_id = exchange.request_id
        if request_id is None:
            return
        same = self._by_request_id.get(request_id)
        if same is not None:
            same.discard(exchange)
            if not same:
                del self._by_request_id[request_id]
        if self._state.shared:
            self._spawn_state_call(self._state.unregister_request(request_id))

    def abort(self, request_id: str) -> int:
        """Cancel, on both halves, every exchange of this replica that carries `request_id`, and refuse those still
        waiting for a pair when their turn comes; how many."""
        # One already failing is not counted again (an abort may come by pub/sub and again at the sync).
        exchanges = [e for e in self._by_request_id.get(request_id, ()) if e.failure is None]
        for exchange in exchanges:
            self._metrics.operator_aborts.labels(exchange.admitted.model).inc()
            exchange.fail(aborted_by_operator())
        waiting = self._queued.get(request_id, 0)
        if waiting:
            self._abort_queued.add(request_id)
        return len(exchanges) + waiting

    def counts(self) -> Counter[str]:
        """Each request id this replica holds, queued or dispatched, with how many times (a client may reuse one)."""
        requests = Counter({request_id: len(held) for request_id, held in self._by_request_id.items()})
        requests.update(self._queued)
        return requests

    def _spawn_state_call(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._state_calls.add(task)
        task.add_done_callback(self._state_calls.discard)
