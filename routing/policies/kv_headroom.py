from __future__ import annotations

from collections.abc import Sequence

from routing.policies.base import RouteKey
from routing.policies.least_outstanding import LeastOutstanding
from routing.workers import Worker


class KvHeadroom:
    """The decode with the most free KV that can take this request now.

    A decode preallocates a request only when its prompt + max new tokens + the engine's reserved decode tokens fit
    (SGLang `DecodePreallocQueue.pop_preallocated`, 512 reserved by default); otherwise its FIFO queue stops there
    and every request behind it waits too. Free KV is the pool less what is in use: the engine's own `/v1/loads`
    reading (other replicas' requests included) or this gateway's reservations in flight on it, whichever is
    larger. A decode where the request fits beats one where it does not; then the most free KV. Requests without
    sizes go to the least loaded."""

    def __init__(self, load_max_age_s: float) -> None:
        self._max_age_s = load_max_age_s
        self._fallback = LeastOutstanding()

    def pick(self, workers: Sequence[Worker], key: RouteKey) -> Worker | None:
        prompt = key.prompt
        if prompt is None or not workers:
            return self._fallback.pick(workers, key)
        need = prompt.tokens + prompt.max_new_tokens
        best: Worker | None = None
        best_rank = (False, 0, 0)
        for worker in workers:
            free = self.free_tokens(worker)
            identity = worker.verified
            reserve = identity.reserved_decode_tokens if identity is not None else 512
            rank = (free >= need + reserve, free, -worker.fleet_in_flight)
            if best is None or rank > best_rank:
                best, best_rank = worker, rank
        return best

    def free_tokens(self, worker: Worker) -> int:
        identity = worker.verified
        if identity is None:
            return 0
        used = max(worker.engine_used_tokens(self._max_age_s) or 0, worker.reserved_tokens)
        return identity.pool_tokens - used
