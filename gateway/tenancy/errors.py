"""What tenancy answers: 401, 429 and, when the shared state is down and the gateway fails closed, 503."""

from __future__ import annotations

import math

from gateway.errors import GatewayError

_REASONS = {"requests": "requests per minute", "prompt_tokens": "prompt tokens per minute",
            "output_tokens": "output tokens per minute", "max_concurrent": "concurrent requests",
            "body_bytes": "request body bytes per minute"}


class Unauthorized(GatewayError):
    def __init__(self, message: str) -> None:
        super().__init__(401, message, type="invalid_request_error", code="invalid_api_key")


class RateLimited(GatewayError):
    def __init__(self, tenant: str, reason: str, retry_after_s: float) -> None:
        super().__init__(429, f"rate limit reached for tenant {tenant!r}: {_REASONS.get(reason, reason)}; "
                         f"retry after {math.ceil(retry_after_s)}s", type="rate_limit_error",
                         code="rate_limit_exceeded")
        self.retry_after_s = max(1, math.ceil(retry_after_s))


class StateDown(GatewayError):
    def __init__(self) -> None:
        super().__init__(503, "the gateway's shared state is unreachable", code="state_unavailable")
        self.retry_after_s = 1
