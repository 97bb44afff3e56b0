"""A model's prefill and decode pools, and the pair chosen for one request."""

from __future__ import annotations

from dataclasses import dataclass

from routing.policies import Policy, RoundRobin
from routing.specs import ModelSpec
from routing.workers import Worker


@dataclass(slots=True, frozen=True)
class WorkerPair:
    prefill: Worker
    decode: Worker


class NoWorkerAvailable(Exception):
    """No usable worker for one of the roles; the message says which and why."""


class ModelPool:
    def __init__(self, name: str, prefill: list[Worker], decode: list[Worker], *,
                 prefill_policy: Policy | None = None, decode_policy: Policy | None = None) -> None:
        self.name = name
        self.prefill = prefill
        self.decode = decode
        self._prefill_policy = prefill_policy or RoundRobin()
        self._decode_policy = decode_policy or RoundRobin()

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    def ready(self) -> bool:
        return any(w.usable for w in self.prefill) and any(w.usable for w in self.decode)

    def pick_pair(self) -> WorkerPair:
        prefill = self._prefill_policy.pick([w for w in self.prefill if w.usable])
        if prefill is None:
            raise NoWorkerAvailable(f"no usable prefill worker for model {self.name!r} ({_why(self.prefill)})")
        decode = self._decode_policy.pick([w for w in self.decode if w.usable])
        if decode is None:
            raise NoWorkerAvailable(f"no usable decode worker for model {self.name!r} ({_why(self.decode)})")
        return WorkerPair(prefill, decode)


def pool_for(model: ModelSpec) -> ModelPool:
    """The model's workers, none in rotation until the KV-pool gate has verified it."""
    return ModelPool(model.name, prefill=[Worker(spec) for spec in model.prefill],
                     decode=[Worker(spec) for spec in model.decode])


def _why(workers: list[Worker]) -> str:
    return "; ".join(f"{w.url}: {w.out_of_rotation_reason}" for w in workers if not w.usable) or "none configured"
