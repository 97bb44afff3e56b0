"""What can go wrong talking to an engine, as a small hierarchy the lifecycle matches on.

The engine client maps every transport and protocol failure into one of these at its edge, so nothing above it
knows which HTTP library carries the bytes.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode", "telemetry"]

# Substrings of SGLang's own prompt-length rejections (tokenizer manager, scheduler and PD queues).
_LENGTH_REJECTIONS = (
    "longer than the model's context length",
    "exceeds the model's maximum context length",
    "exceeds the maximum allowed length",
    "exceeds the maximum number of tokens",
)


def is_length_rejection(message: str) -> bool:
    return any(fragment in message for fragment in _LENGTH_REJECTIONS)


class EngineError(Exception):
    """An engine could not be used for a request; `role` says which half."""

    def __init__(self, role: Role, message: str) -> None:
        super().__init__(message)
        self.role = role
        self.message = message


class EngineUnreachable(EngineError):
    """No connection could be opened: the request provably never reached the engine."""


class EngineChanged(EngineError):
    """A new connection found a different engine than the one the KV-pool gate verified (a restart): nothing was
    sent on it, and the worker must be read and judged again before it gets traffic."""


class EngineTimeout(EngineError):
    """The engine did not answer, or stopped sending, within the time allowed."""


class EngineRejected(EngineError):
    """The engine answered with an error: a non-2xx status, or an error or abort reported inside a 2xx."""

    def __init__(self, role: Role, message: str, *, status: int, detail: str = "") -> None:
        super().__init__(role, message)
        self.status = status
        self.detail = detail  # the engine's own words, when it gave any
        self.length_rejection = is_length_rejection(message)


class EngineBroken(EngineError):
    """The connection dropped or the engine sent something unparseable after the request went out: its fate on
    the engine is unknown."""
