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


# Statuses by which an engine rejects the request itself (its words then say what to change).
_REQUEST_REJECTIONS = frozenset({400, 413, 422, 429})


def is_length_rejection(message: str) -> bool:
    return any(fragment in message for fragment in _LENGTH_REJECTIONS)


class EngineError(Exception):
    """An engine could not be used for a request; `role` says which half. The message names the worker's address
    (`worker_url`) for the operator's log; `public_message` is what a client may read."""

    def __init__(self, role: Role, message: str, *, worker_url: str | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.message = message
        self.worker_url = worker_url

    @property
    def public_message(self) -> str:
        """The message naming the role, not the internal address behind it."""
        if self.worker_url is None:
            return self.message
        return self.message.replace(f"{self.role} worker {self.worker_url}", f"the {self.role} engine")


class EngineUnreachable(EngineError):
    """No connection could be opened: the request provably never reached the engine."""

    @property
    def public_message(self) -> str:  # the socket's words name addresses (a peer's IP, a certificate's host)
        return f"the {self.role} engine could not be reached"


class EngineChanged(EngineError):
    """A new connection found a different engine than the one the KV-pool gate verified (a restart): nothing was
    sent on it, and the worker must be read and judged again before it gets traffic."""

    @property
    def public_message(self) -> str:
        return f"the {self.role} engine changed since it was verified and awaits re-verification"


class EngineTimeout(EngineError):
    """The engine did not answer, or stopped sending, within the time allowed."""


class EngineRejected(EngineError):
    """The engine answered with an error: a non-2xx status, or an error or abort reported inside a 2xx."""

    def __init__(self, role: Role, message: str, *, status: int, detail: str = "",
                 worker_url: str | None = None) -> None:
        super().__init__(role, message, worker_url=worker_url)
        self.status = status
        self.detail = detail  # the engine's own words, when it gave any
        self.length_rejection = is_length_rejection(message)

    @property
    def public_message(self) -> str:
        """A rejection of the request itself keeps the engine's words, which say what to change; any other answer's
        (a 5xx, a proxy's 404 page, a redirect) describe the engine's internals and stay in the log."""
        if self.status in _REQUEST_REJECTIONS or self.length_rejection:
            return super().public_message
        return f"the {self.role} engine answered {self.status}"


class EngineBroken(EngineError):
    """The connection dropped or the engine sent something unparseable after the request went out: its fate on
    the engine is unknown."""

    @property
    def public_message(self) -> str:
        if self.worker_url is None:
            return self.message  # the gateway's own words ("decode stream ended before its first token", …)
        return f"the {self.role} engine's connection broke"


class EngineAnswerTooLarge(EngineBroken):
    """The engine sent an answer, or one streamed event, larger than the gateway reads (`limits.engine_*_bytes`):
    its connection is closed at the cap, so what it sent beyond is never held."""

    def __init__(self, role: Role, what: str, limit: int, *, worker_url: str | None = None) -> None:
        super().__init__(role, f"the {role} engine sent {what} over the cap of {limit} bytes", worker_url=worker_url)
        self.limit = limit

    @property
    def public_message(self) -> str:
        return self.message
