"""What one client request was and how it went: filled in along its path by the proxy, read at its end by metrics,
traces and the access log. Never holds prompt text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from gateway.admission.admit import AdmittedRequest
    from gateway.pd.exchange import PDExchange


@dataclass(slots=True)
class RequestRecord:
    route: str
    request_id: str  # the x-request-id every answer carries: the client's own when sane, else a new one
    started_at: float = field(default_factory=time.monotonic)
    model: str = ""  # a configured model's name, once known
    status: int = 0  # 0 until a response started (499 in metrics: the client left first)
    admitted: AdmittedRequest | None = None
    admission_s: float | None = None
    queue_s: float | None = None
    refused: GatewayError | None = None  # answered before any engine saw it
    exchange: PDExchange | None = None
    span: Span | None = None  # the request's trace span, when tracing
    trace_id: str | None = None
    engine_traceparent: str | None = None  # sent to both engines
    tenant: str = ""
    sampled: bool = False  # for output provenance: the answer's bytes are kept in `answer` (bounded)
    probe: bool = False  # the gateway's own canary traffic
    answer: bytearray = field(default_factory=bytearray)
