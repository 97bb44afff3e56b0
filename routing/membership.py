"""Which workers each model has, beyond the configuration file: added and removed by an operator, a reload or DNS.

A worker joins only after the KV-pool gate has read and passed it (a worker that fails is not kept); one that leaves
is drained — no new requests, those in flight finish on it — and dropped from its pool at once, so nothing new can
pick it while its last requests run."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from routing.monitor import WorkerMonitor
from routing.pools import ModelPool
from routing.stable_hash import stable_hash
from routing.workers import Worker, WorkerSpec

log = logging.getLogger("kvgate.membership")


class WorkerRefused(Exception):
    """The KV-pool gate did not pass a worker being added; the message says why."""


class WorkerExists(Exception):
    pass


def worker_id(model: str, worker: Worker) -> str:
    return format(stable_hash(model.encode(), worker.role.encode(), worker.url.encode()), "016x")[:12]


@dataclass(frozen=True, slots=True)
class Member:
    model: str
    worker: Worker

    @property
    def id(self) -> str:
        return worker_id(self.model, self.worker)

    def describe(self) -> dict[str, Any]:
        w = self.worker
        identity = w.verified
        return {
            "id": self.id, "model": self.model, "role": w.role, "url": w.url, "bootstrap_port": w.bootstrap_port,
            "origin": w.spec.origin, "in_rotation": w.usable, "reason": w.out_of_rotation_reason or None,
            "healthy": w.healthy, "draining": w.draining, "breaker": w.breaker_state.value,
            "in_flight": w.in_flight, "fleet_in_flight": w.fleet_in_flight,
            "engine_load": w.engine_load(max_age_s=60),
            "gate": None if identity is None else {"pool_tokens": identity.pool_tokens,
                                                   "max_req_input_len": identity.max_req_input_len,
                                                   "version": identity.version},
            "checks": [{"check": c.check, "result": c.result, "value": c.value, "safe": c.safe, "policy": c.policy}
                       for c in w.checks],
            "prefill_backlog_tokens": w.prefill_backlog, "reserved_tokens": w.reserved_tokens,
            "cache": None if w.cache_index is None else {
                "mode": w.cache_index.mode.value, "block_tokens": w.cache_index.block_tokens,
                "capacity_blocks": w.cache_index.capacity_blocks, "sent_blocks": w.cache_index.sent_blocks,
                "held_blocks": w.cache_index.held_blocks, "events_refused": w.cache_index.events_refused,
                "view_overflows": w.cache_index.view_overflows},
        }


class Membership:
    def __init__(self, pools: dict[str, ModelPool], monitor: WorkerMonitor) -> None:
        self._pools = pools
        self._monitor = monitor

    def members(self) -> list[Member]:
        return [Member(name, worker) for name, pool in self._pools.items() for worker in pool.workers]

    def find(self, member_id: str) -> Member | None:
        return next((m for m in self.members() if m.id == member_id), None)

    def find_url(self, model: str, role: str, url: str) -> Member | None:
        return next((m for m in self.members() if m.model == model and m.worker.role == role
                     and m.worker.url == url), None)

    async def add(self, model: str, spec: WorkerSpec) -> Member:
        """Add a worker once the gate passes it; raises WorkerRefused (and keeps nothing) when it does not."""
        pool = self._pools[model]
        if self.find_url(model, spec.role, spec.url) is not None:
            raise WorkerExists(f"{spec.role} worker {spec.url} is already part of model {model!r}")
        worker = pool.new_worker(spec)
        pool.add(worker)
        self._monitor.watch(model, worker)
        try:
            judgement = await self._monitor.verify_now(model)
        finally:
            if worker.verified is None:
                pool.remove(worker)  # never kept unless the gate passed it, whatever happened meanwhile
        if worker.verified is None:
            problems = next((v.problems for v in judgement.workers if v.worker is worker), [])
            raise WorkerRefused(f"{spec.role} worker {spec.url} refused by the KV-pool gate: "
                                + ("; ".join(problems) or worker.out_of_rotation_reason))
        log.info("worker %s (%s) joined model %s (%s)", spec.url, spec.role, model, spec.origin)
        return Member(model, worker)

    def drain(self, member: Member) -> None:
        member.worker.drain()

    def remove(self, member: Member) -> None:
        """Drain and drop: requests in flight finish on it; nothing new can pick it."""
        member.worker.drain()
        self._pools[member.model].remove(member.worker)
        log.info("worker %s (%s) left model %s (%d in flight finish on it)", member.worker.url, member.worker.role,
                 member.model, member.worker.in_flight)
