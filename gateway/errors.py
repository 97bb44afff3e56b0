"""Errors the gateway answers with, in OpenAI's error shape.

Every failure becomes a `GatewayError` carrying its HTTP status; nothing maps a failure to 200.
"""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    """A request failed; `status` and the OpenAI-style body say how."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail  # what the operator's log gets beyond the message (worker addresses, an engine's words)
        self.type = type or _default_type(status)
        self.code = code
        self.param = param
        self.model: str | None = None  # the served model it concerns, once known (for metrics; never sent)
        self.retry_after_s: int | None = None  # sent as Retry-After when set (overload: the client may retry)

    def __reduce__(self) -> tuple[object, ...]:
        # Picklable (it crosses from the admission worker process): rebuilt from its fields, not from `args`.
        return (_rebuild, (type(self), self.status, self.message, self.type, self.code, self.param, self.model,
                           self.detail))

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    def sse_event(self) -> bytes:
        """The error as a final server-sent event, for a stream that has already started."""
        return b"data: " + self.json() + b"\n\n"


def _rebuild(cls: type[GatewayError], status: int, message: str, type: str, code: str | None,
             param: str | None, model: str | None = None, detail: str | None = None) -> GatewayError:
    error = Exception.__new__(cls)
    GatewayError.__init__(error, status, message, type=type, code=code, param=param, detail=detail)
    error.model = model
    return error


def _default_type(status: int) -> str:
    if status in (400, 404, 405, 413, 415, 422):
        return "invalid_request_error"
    if status == 503:
        return "service_unavailable"
    if status == 504:
        return "timeout"
    return "upstream_error" if status == 502 else "server_error"


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def context_length_exceeded(message: str, *, param: str = "messages") -> GatewayError:
    return GatewayError(413, message, param=param, code="context_length_exceeded")


# Errors raised from more than one place, named once.
def shutting_down() -> GatewayError:
    return GatewayError(503, "the gateway is shutting down", code="shutting_down")


def aborted_by_operator() -> GatewayError:
    return GatewayError(503, "the request was aborted by an operator", code="aborted_by_operator")


def model_unavailable(name: str, reason: str, *, detail: str | None = None) -> GatewayError:
    return GatewayError(503, f"model {name!r} is not served: {reason}", code="model_unavailable", detail=detail)


def model_disabled(name: str) -> GatewayError:
    return GatewayError(503, f"model {name!r} was disabled by an operator", code="model_disabled")
