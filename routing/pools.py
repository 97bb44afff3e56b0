"""A model's prefill and decode pools: which pair serves one request, and the bounded wait when every worker is full.

Overload answers 503 with Retry-After, never 502, and never takes a worker out of rotation: a full worker is not a
failing one."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from routing.breaker import BreakerSpec
from routing.policies import NO_KEY, Policy, RouteKey
from routing.policies.round_robin import RoundRobin
from routing.specs import ModelSpec, PoolLimits
from routing.workers import Role, Worker, WorkerSpec


@dataclass(slots=True, frozen=True)
class WorkerPair:
    prefill: Worker
    decode: Worker


class Lease:
    """A pair with one request counted on each of its workers until `release()`: taken in the same step as the pick,
    so two requests woken together cannot both take the last slot."""

    __slots__ = ("pair", "_held")

    def __init__(self, pair: WorkerPair) -> None:
        self.pair = pair
        pair.prefill.begin_request()
        pair.decode.begin_request()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.pair.decode.end_request()
            self.pair.prefill.end_request()


class NoWorkerAvailable(Exception):
    """No worker of a role is in rotation; the message says which and why."""


class PoolSaturated(Exception):
    """Every worker in rotation is at its concurrency limit and the wait queue is full, or the wait timed out."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _AtCapacity(Exception):
    pass


class ModelPool:
    def __init__(self, name: str, prefill: Sequence[Worker], decode: Sequence[Worker], *,
                 prefill_policy: Policy | None = None, decode_policy: Policy | None = None,
                 limits: PoolLimits = PoolLimits(), breaker: BreakerSpec = BreakerSpec()) -> None:
        self.name = name
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self.limits = limits
        self.breaker = breaker
        self._policies: dict[Role, Policy] = {"prefill": prefill_policy or RoundRobin(),
                                              "decode": decode_policy or RoundRobin()}
        self._waiters: deque[asyncio.Future[None]] = deque()
        for worker in [*prefill, *decode]:
            self.add(worker)

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    def policy(self, role: Role) -> Policy:
        return self._policies[role]

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def new_worker(self, spec: WorkerSpec) -> Worker:
        """A worker with this pool's concurrency limit and breaker settings (not in the pool, not verified yet)."""
        return Worker(spec, breaker=self.breaker, max_inflight=self.limits.max_inflight_per_worker)

    def reconfigure(self, *, limits: PoolLimits, breaker: BreakerSpec, prefill_policy: Policy,
                    decode_policy: Policy) -> None:
        """New settings for new requests; requests in flight keep their pair."""
        self.limits, self.breaker = limits, breaker
        self._policies = {"prefill": prefill_policy, "decode": decode_policy}
        for worker in self.workers:
            worker.reconfigure(breaker=breaker, max_inflight=limits.max_inflight_per_worker)
        self._wake_one(None)  # a higher limit may let a waiting request in

    def add(self, worker: Worker) -> None:
        (self.prefill if worker.role == "prefill" else self.decode).append(worker)
        worker.on_released(self._wake_one)

    def remove(self, worker: Worker) -> None:
        members = self.prefill if worker.role == "prefill" else self.decode
        if worker in members:
            members.remove(worker)

    def ready(self) -> bool:
        return any(w.usable for w in self.prefill) and any(w.usable for w in self.decode)

    def pick_pair(self, key: RouteKey = NO_KEY, *, exclude: Collection[Worker] = ()) -> Lease:
        """A pair with room now. Raises NoWorkerAvailable when a role has no worker in rotation, PoolSaturated when
        every one of them is full (callers that may wait use `acquire_pair`)."""
        try:
            return self._pick(key, exclude)
        except _AtCapacity as exc:
            raise PoolSaturated(str(exc), self._retry_after_s()) from None

    async def acquire_pair(self, key: RouteKey = NO_KEY) -> Lease:
        """A pair with room, waiting in a bounded FIFO queue while every worker in rotation is full."""
        try:
            return self._pick(key, ())
        except _AtCapacity as exc:
            full = str(exc)
        if len(self._waiters) >= self.limits.max_queue:
            raise PoolSaturated(f"model {self.name!r} is at capacity and its queue is full ({full})",
                                self._retry_after_s())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.queue_timeout_s
        front = False
        while True:
            waiter = loop.create_future()
            (self._waiters.appendleft if front else self._waiters.append)(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                raise PoolSaturated(f"model {self.name!r} stayed at capacity for {self.limits.queue_timeout_s:g}s "
                                    f"({full})", self._retry_after_s()) from None
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            try:
                return self._pick(key, ())
            except _AtCapacity as exc:
                full, front = str(exc), True  # woken but beaten to the slot: keep its place at the front

    def _pick(self, key: RouteKey, exclude: Collection[Worker]) -> Lease:
        prefill = self._pick_role("prefill", self.prefill, key, exclude)
        decode = self._pick_role("decode", self.decode, key, exclude)
        return Lease(WorkerPair(prefill, decode))

    def _pick_role(self, role: Role, workers: list[Worker], key: RouteKey, exclude: Collection[Worker]) -> Worker:
        in_rotation = [w for w in workers if w.usable and w not in exclude]
        if not in_rotation:
            raise NoWorkerAvailable(f"no usable {role} worker for model {self.name!r} ({_why(workers, exclude)})")
        with_room = [w for w in in_rotation if w.has_room]
        if not with_room:
            raise _AtCapacity(f"all {len(in_rotation)} {role} workers at "
                              f"{self.limits.max_inflight_per_worker} requests in flight")
        picked = self._policies[role].pick(with_room, key)
        assert picked is not None
        return picked

    def _wake_one(self, _: Worker | None) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _retry_after_s(self) -> int:
        return max(1, min(30, math.ceil(self.limits.queue_timeout_s)))


def pool_for(model: ModelSpec, *, prefill_policy: Policy | None = None,
             decode_policy: Policy | None = None) -> ModelPool:
    """The model's workers, none in rotation until the KV-pool gate has verified it."""
    pool = ModelPool(model.name, prefill=[], decode=[], prefill_policy=prefill_policy, decode_policy=decode_policy,
                     limits=model.limits, breaker=model.breaker)
    for spec in [*model.prefill, *model.decode]:
        pool.add(pool.new_worker(spec))
    return pool


def _why(workers: list[Worker], exclude: Collection[Worker]) -> str:
    reasons = [f"{w.url}: {'tried already' if w in exclude else w.out_of_rotation_reason}" for w in workers
               if w in exclude or not w.usable]
    return "; ".join(reasons) or "none configured"
