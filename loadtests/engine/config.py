"""Engine settings (one per process) and the limits SGLang derives from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .dialect import Dialect, dialect_of
from .kv_event_publisher import KvEventsConfig

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's FAKE transfer backend: health checks and warmup skip the KV handoff


@dataclass(frozen=True)
class EngineConfig:
    role: str  # "prefill" | "decode"
    host: str
    port: int
    bootstrap_port: int
    model: str
    pool_tokens: int
    context_length: int
    page_size: int
    tokenizer: str
    chat_template: str | None
    bug: bool
    prefill_tokens_per_s: float
    first_token_delay_ms: float
    token_delay_ms: float
    version: str
    bootstrap_timeout_s: float
    waiting_timeout_s: float
    enable_metrics: bool
    disconnect_poll_s: float
    stream_abort_delay_s: float
    health_delay_s: float
    request_log_size: int
    # PD safety settings, reported in /server_info as SGLang 0.5.22+ does (see `info.server_args`)
    transfer_backend: str = "mooncake"
    enable_kv_checksum: bool = False
    decode_allocation_policy: str = "early"
    expose_env_vars: bool = False  # SGLANG_EXPOSE_OWN_ENV_VARS=1: internal_states[*].env_vars lists `env`
    env: tuple[tuple[str, str], ...] = ()  # environment variables set explicitly (SGLANG_* only are reported)
    report_pool_tokens: int | None = None  # a lying engine (tests of the integrity guards): server info claims it
    # Pools of further data-parallel ranks (SGLang: one scheduler per rank, each with its own pool; server info's
    # top level is rank 0's, internal_states[i].memory_usage.token_capacity rank i's). Reported, not enforced.
    dp_rank_pool_tokens: tuple[int, ...] = ()
    hide_stub: bool = False  # a lying engine: a bug-mode stub reports the original prompt's token count
    default_chat_template_kwargs: dict[str, Any] | None = None  # --default-chat-template-kwargs (0.5.22+)
    cache_tokens: int | None = None  # prefix-cache capacity (--cache-tokens); None: the pool's size
    kv_events_config: str | None = None  # --kv-events-config, the JSON string as ServerArgs keeps it
    enable_cache_report: bool = False  # --enable-cache-report: OpenAI usage carries prompt_tokens_details
    num_reserved_decode_tokens: int = 512  # decode: KV headroom a request needs before it is preallocated

    @property
    def dialect(self) -> Dialect:
        return dialect_of(self.version)

    @property
    def kv_events(self) -> KvEventsConfig | None:
        """The parsed --kv-events-config (validated at startup by the CLI)."""
        if self.kv_events_config is None:
            return None
        return KvEventsConfig.parse(self.kv_events_config, self.dialect)

    @property
    def cache_capacity(self) -> int:
        return self.max_total_num_tokens if self.cache_tokens is None else self.cache_tokens

    @property
    def max_total_num_tokens(self) -> int:
        return self.pool_tokens // self.page_size * self.page_size

    @property
    def max_req_len(self) -> int:
        return min(self.context_length - 1, self.max_total_num_tokens - 1)

    @property
    def reported_pool_tokens(self) -> int:
        return self.report_pool_tokens if self.report_pool_tokens is not None else self.max_total_num_tokens

    @property
    def reported_max_req_input_len(self) -> int:
        return min(self.context_length - 1, self.reported_pool_tokens - 1) - 5

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5
