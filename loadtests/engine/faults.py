"""Fault injection rules set through `POST /emu/faults`.

A rule applies to the requests it matches (`path` exact, `rid_prefix`) and, when `count` is given, only to that many
of them, after which it retires itself; so a test can scope a fault to exactly the requests it sends.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

# kind -> where it acts
ACTIONS = {
    "fail": "generation",  # answer `status` after `delay_ms`
    "drop": "generation",  # close the connection after `after_chunks` stream chunks (non-stream: before answering)
    "hang": "generation",  # never answer (until the client goes away)
    "slow_first_token": "generation",  # add `delay_ms` before the first token
    "miscount": "generation",  # run normally but report prompt_tokens off by `offset`
    "error_body": "generation",  # SGLang's OpenAI error object under `status` (in a stream: an event, HTTP 200)
    "bad_chunk": "generation",  # a stream whose last event before the end is not JSON (a corrupt chunk)
    "huge": "generation",  # HTTP 200 and `size` bytes: streamed, one event that never ends; else a chunked JSON body
    "abort_object": "generation",  # HTTP 200, a choice (or meta_info) whose finish_reason is {"type": "abort", ...}
    "health": "health",  # /health and /health_generate answer `status` (default 503)
    "refuse_bootstrap": "bootstrap",  # the prefill's bootstrap server refuses KV handshakes
}
_DEFAULT_STATUS = {"health": 503, "error_body": 200}
_ids = itertools.count(1)


class FaultError(ValueError):
    pass


@dataclass
class Fault:
    action: str
    status: int = 500
    delay_ms: float = 0.0
    after_chunks: int = 0
    path: str | None = None
    rid_prefix: str | None = None
    count: int | None = None
    message: str = "Injected fault"
    offset: int = 0
    code: int = 500
    size: int = 0
    id: int = field(default_factory=lambda: next(_ids))
    hits: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fault:
        if not isinstance(d, dict) or d.get("action") not in ACTIONS:
            raise FaultError(f"fault needs 'action' in {sorted(ACTIONS)}")
        known = {"action", "status", "delay_ms", "after_chunks", "path", "rid_prefix", "count", "message", "offset",
                 "code", "size"}
        unknown = set(d) - known
        if unknown:
            raise FaultError(f"unknown fault fields: {sorted(unknown)}")
        f = cls(**d)
        if any(not isinstance(v, int) or isinstance(v, bool) for v in (f.offset, f.code, f.status, f.size)):
            raise FaultError("'offset', 'code', 'status' and 'size' must be integers")
        if "status" not in d:
            f.status = _DEFAULT_STATUS.get(f.action, f.status)
        return f

    @property
    def error_type(self) -> str:
        """The OpenAI error `type` SGLang pairs with `code`."""
        return {400: "BadRequestError", 500: "InternalServerError"}.get(self.code, str(self.code))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class FaultSet:
    def __init__(self) -> None:
        self.rules: list[Fault] = []

    def add(self, f: Fault) -> None:
        self.rules.append(f)

    def clear(self) -> None:
        self.rules.clear()

    def take(self, scope: str, path: str = "", rid: str = "") -> Fault | None:
        """The first live rule for this scope that matches; consumes one unit of its count."""
        if not self.rules:  # hot path: no faults configured
            return None
        for f in self.rules:
            if ACTIONS[f.action] != scope:
                continue
            if f.path is not None and f.path != path:
                continue
            if f.rid_prefix is not None and not rid.startswith(f.rid_prefix):
                continue
            f.hits += 1
            if f.count is not None:
                f.count -= 1
                if f.count <= 0:
                    self.rules.remove(f)
            return f
        return None

    def active(self, scope: str) -> bool:
        """Whether a rule for this scope is live, without consuming it (the bootstrap refusal is a state)."""
        return any(ACTIONS[f.action] == scope for f in self.rules)
