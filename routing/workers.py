"""Workers: one SGLang engine each, with what the gateway knows about its health and KV-pool contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

Role = Literal["prefill", "decode"]


@dataclass(slots=True)
class WorkerTelemetry:
    """What the engine reported about itself (routing.gate reads it)."""

    pool_tokens: int
    max_req_input_len: int
    context_length: int | None
    page_size: int
    version: str
    disaggregation_mode: str
    served_model_name: str | None
    tokenizer_path: str | None


@dataclass(slots=True, eq=False)
class Worker:
    url: str
    role: Role
    bootstrap_port: int | None = None
    healthy: bool = True
    # False until the KV-pool gate has verified the worker, and again whenever it fails a re-check.
    admitted: bool = True
    gate_reason: str = ""
    telemetry: WorkerTelemetry | None = None
    in_flight: int = 0
    bootstrap_host: str = field(init=False)

    def __post_init__(self) -> None:
        host = urlsplit(self.url).hostname or ""
        # SGLang expects a bracketed IPv6 literal in bootstrap_host, as its own router sends it.
        self.bootstrap_host = f"[{host}]" if ":" in host else host

    @property
    def usable(self) -> bool:
        return self.healthy and self.admitted
