"""A model's prefill and decode pools: which pair serves one request, and the bounded wait when every worker is full.

Overload answers 503 with Retry-After, never 502, and never takes a worker out of rotation: a full worker is not a
failing one."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from routing.breaker import BreakerSpec
from routing.policies import NO_KEY, Policy, RouteKey
from routing.policies.round_robin import RoundRobin
from routing.prefix_index import PromptTokens
from routing.specs import ModelSpec, PoolLimits
from routing.workers import Role, Worker, WorkerSpec


@dataclass(slots=True, frozen=True)
class WorkerPair:
    prefill: Worker
    decode: Worker


class Lease:
    """A pair with one request counted on each of its workers until `release()`: taken in the same step as the pick,
    so two requests woken together cannot both take the last slot. With the prompt's sizes known (`RouteKey.prompt`),
    it also counts the prefill's uncached work until `prefill_done()` and the KV the request may take on decode."""

    __slots__ = ("_decode_tokens", "_held", "_prefill_work", "_reported", "_tickets", "pair", "predicted_cached")

    def __init__(self, pair: WorkerPair, prompt: PromptTokens | None = None) -> None:
        self.pair = pair
        # Prompt tokens the cache-aware pick expected the prefill to hold (None: no prediction was made).
        self.predicted_cached = prompt.predicted_cached if prompt is not None and prompt.ids else None
        self._prefill_work = prompt.tokens - prompt.predicted_cached if prompt is not None else 0
        self._decode_tokens = prompt.tokens + prompt.max_new_tokens if prompt is not None else 0
        self._tickets = (pair.prefill.begin_request(prefill_tokens=self._prefill_work),
                         pair.decode.begin_request(reserve_tokens=self._decode_tokens))
        self._held = True
        self._reported: set[tuple[bool, bool]] = set()  # (is decode, success) outcomes already reported

    def report(self, worker: Worker, success: bool) -> None:
        """What this request says of one of its workers, to that worker's breaker with the ticket it handed out: a
        success once and a failure once (a failure may follow a success, e.g. a stream that broke after its first
        token)."""
        decode = worker is self.pair.decode
        if (decode, success) not in self._reported:
            self._reported.add((decode, success))
            worker.record_outcome(success, self._tickets[1] if decode else self._tickets[0])

    def prefill_done(self) -> None:
        """Prefill answered (or never will): its work no longer queues on the engine."""
        if self._prefill_work:
            self.pair.prefill.end_prefill(self._prefill_work)
            self._prefill_work = 0

    def release(self) -> None:
        if self._held:
            self._held = False
            self.prefill_done()
            self.pair.decode.end_request(self._tickets[1], reserve_tokens=self._decode_tokens)
            self.pair.prefill.end_request(self._tickets[0])


class NoWorkerAvailable(Exception):
    """No worker of a role is in rotation. The message says which and why, worker by worker (for the log);
    `public_message` only which role (for the client, who has no use for the workers' addresses)."""

    def __init__(self, role: str, model: str, why: str) -> None:
        super().__init__(f"no usable {role} worker for model {model!r} ({why})")
        self.public_message = f"no usable {role} worker for model {model!r}"


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
        self._woken = 0  # waiters woken that have not run yet: a slot freed for them is theirs
        self._on_add: list[Callable[[Worker], None]] = []
        self._on_remove: list[Callable[[Worker], None]] = []
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
            worker.reconfigure(breaker=breaker, max_inflight=limits.max_inflight_per_worker)  # wakes waiters

    def add(self, worker: Worker) -> None:
        (self.prefill if worker.role == "prefill" else self.decode).append(worker)
        worker.on_capacity(self._wake_one)
        for callback in self._on_add:
            callback(worker)
        self._wake_one(worker)

    def remove(self, worker: Worker) -> None:
        members = self.prefill if worker.role == "prefill" else self.decode
        if worker in members:
            members.remove(worker)
            for callback in self._on_remove:
                callback(worker)

    def follow(self, on_add: Callable[[Worker], None], on_remove: Callable[[Worker], None]) -> None:
        """`on_add(worker)` for every worker in the pool now and added later; `on_remove` for each one removed."""
        self._on_add.append(on_add)
        self._on_remove.append(on_remove)
        for worker in self.workers:
            on_add(worker)

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
        """A pair with room, waiting in a bounded FIFO queue while every worker in rotation is full. A request that
        arrives while others wait queues behind them, even if a slot is free this instant (it is theirs)."""
        full = "requests are waiting"
        if not self._waiters and not self._woken:
            try:
                return self._pick(key, ())
            except _AtCapacity as exc:
                full = str(exc)
        else:
            self._check_roles()  # a role with no worker at all answers at once, not after a wait
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
            except BaseException as exc:  # timed out, or the client went away
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._woken -= 1
                    self._wake_one(None)  # it was woken for a slot it will not take: pass the turn on
                if isinstance(exc, TimeoutError):
                    raise PoolSaturated(f"model {self.name!r} stayed at capacity for "
                                        f"{self.limits.queue_timeout_s:g}s ({full})", self._retry_after_s()) from None
                raise
            self._woken -= 1
            try:
                lease = self._pick(key, ())
            except _AtCapacity as exc:
                full, front = str(exc), True  # woken but the slot went elsewhere: keep its place at the front
                continue
            except NoWorkerAvailable:
                self._wake_one(None)
                raise
            self._wake_one(None)  # there may be room for the next one too: it tries, and queues again if not
            return lease

    def _pick(self, key: RouteKey, exclude: Collection[Worker]) -> Lease:
        prefill_ready, decode_ready = self._check_roles(exclude)
        prefill = self._pick_role("prefill", prefill_ready, key)
        decode = self._pick_role("decode", decode_ready, key)
        return Lease(WorkerPair(prefill, decode), key.prompt)

    def _check_roles(self, exclude: Collection[Worker] = ()) -> tuple[list[Worker], list[Worker]]:
        """Each role's workers in rotation; NoWorkerAvailable when a role has none (checked before any capacity)."""
        found = []
        for role, workers in (("prefill", self.prefill), ("decode", self.decode)):
            in_rotation = [w for w in workers if w.usable and w not in exclude]
            if not in_rotation:
                raise NoWorkerAvailable(role, self.name, _why(workers, exclude))
            found.append(in_rotation)
        return found[0], found[1]

    def _pick_role(self, role: Role, in_rotation: list[Worker], key: RouteKey) -> Worker:
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
                self._woken += 1
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
