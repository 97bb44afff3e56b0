"""Engine failures as the client hears them, and which engine a failure is blamed on (its breaker's business)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.errors import GatewayError
from routing.engines.errors import (
    EngineAnswerTooLarge,
    EngineChanged,
    EngineError,
    EngineRejected,
    EngineTimeout,
)

# How SGLang's decode words a failure of the bootstrap or the KV transfer from its prefill.
_TRANSFER_FAILURE = re.compile(r"(?i)bootstrap|transfer|prefill")
_PREFILL_TRANSFER_FAILURE = re.compile(r"(?i)bootstrap|transfer|decode")


@dataclass(frozen=True, slots=True)
class PromptMismatch:
    """An engine reported a prompt length other than the gateway counted (never carries prompt text)."""

    role: str
    worker: str
    reported: int | None
    expected: int


class PromptCountMismatch(Exception):
    """An engine's own prompt count differs from the gateway's: the request must not produce output."""


def map_engine_error(error: EngineError) -> GatewayError:
    """Engine failures → client statuses: 400 stays 400 (413 for a length rejection), a changed worker 503, other
    rejections, broken or unreachable connections and answers over the read caps 502, timeouts 504. Never 200.
    The client reads the role, not the worker's address; the whole message goes to the access log."""
    role = error.role
    match error:
        case EngineTimeout():
            status, code = 504, f"{role}_timeout"
        case EngineChanged():
            status, code = 503, "worker_changed"
        case EngineRejected(length_rejection=True):
            status, code = 413, "context_length_exceeded"
        case EngineRejected(status=400):
            status, code = 400, f"{role}_bad_request"
        case EngineRejected(status=429):
            status, code = 503, f"{role}_overloaded"
        case EngineAnswerTooLarge():  # the engine's fault: blamed on it like a broken connection
            status, code = 502, f"{role}_answer_too_large"
        case _:
            status, code = 502, f"{role}_failed"
    return GatewayError(status, error.public_message, code=code, detail=str(error))


def connect_failure(error: EngineError, *also: EngineError) -> GatewayError:
    """Nothing was sent to either engine. One too busy to take or confirm a connection in time is overloaded: 503 with
    Retry-After (the client may simply retry), not a timeout of its request. The client hears of the first half's
    failure; the log gets both."""
    if isinstance(error, EngineTimeout):
        answer = GatewayError(503, f"{error.public_message}; nothing was sent, retry", code=f"{error.role}_busy")
        answer.retry_after_s = 1
    else:
        answer = map_engine_error(error)
    answer.detail = "; ".join(str(each) for each in (error, *also))
    return answer


def prefill_may_be_victim(error: EngineError, *, first_token: bool) -> bool:
    """A prefill that reports a failed KV transfer before decode produced anything may be the decode's victim."""
    return not first_token and isinstance(error, EngineRejected) \
        and bool(_PREFILL_TRANSFER_FAILURE.search(error.detail))


def decode_may_be_victim(error: EngineError, *, first_token: bool, prefill_ok: bool) -> bool:
    """A decode failure before its first token while prefill has not delivered may be the KV transfer's or the
    prefill's (SGLang's decode reports a lost bootstrap or transfer as its own 500)."""
    return not first_token and not prefill_ok and isinstance(error, EngineRejected) \
        and bool(_TRANSFER_FAILURE.search(error.detail))
