"""The gateway's YAML configuration, validated with pydantic.

A bad file fails at startup with `ConfigError`, whose message names the offending key and the reason.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from gateway.template_kwargs import NOT_TEMPLATE_VARIABLES


class ConfigError(Exception):
    """The configuration file cannot be used; the message says which key and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


class TimeoutsConfig(_Strict):
    """Per-phase limits of one PD request, in seconds."""

    connect_s: float = Field(5.0, gt=0)
    prefill_s: float = Field(600.0, gt=0, description="dispatch until prefill has answered")
    first_token_s: float = Field(600.0, gt=0, description="dispatch until decode's first token (a non-streaming "
                                 "request's whole answer shows none: until prefill has answered, then total_s)")
    idle_s: float = Field(60.0, gt=0, description="longest silence between two decode chunks")
    total_s: float = Field(1800.0, gt=0, description="whole request, end to end")
    abort_s: float = Field(5.0, gt=0, description="one /abort_request call")
    client_head_s: float = Field(10.0, gt=0, description="a connection's request head (idle sockets are closed)")
    client_body_s: float = Field(30.0, gt=0, description="a client's whole body, once its head is in")


class KvEventsConfig(_Strict):
    """Where a prefill engine publishes its KV events (SGLang `--kv-events-config`), as kvgate connects to it."""

    endpoint: str = Field(description="the PUB socket, e.g. tcp://10.0.0.5:5557 (port + rank for each DP rank)")
    replay_endpoint: str | None = Field(None, description="the ROUTER replay socket, e.g. tcp://10.0.0.5:5558")
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"expected a tcp:// or ipc:// ZMQ endpoint, got {value!r}")
        return value


class PrefillWorkerConfig(_Strict):
    url: str
    bootstrap_port: int | None = Field(8998, ge=1, le=65535)
    kv_events: KvEventsConfig | None = Field(None, description="cache_aware: the engine's KV events (default: read "
                                                               "from its /server_info kv_events_config)")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return _validate_worker_url(url)


class DecodeWorkerConfig(_Strict):
    url: str

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return _validate_worker_url(url)


class DnsWorkersConfig(_Strict):
    """A role's workers from DNS: the A/AAAA records of a name (e.g. a Kubernetes headless Service), re-read every
    `interval_s`. A new address passes the KV-pool gate before it gets traffic; one that disappears is drained."""

    dns: str = Field(description="NAME:PORT")
    bootstrap_port: int | None = Field(8998, ge=1, le=65535, description="prefill only")
    interval_s: float = Field(5.0, gt=0)
    scheme: Literal["http", "https"] = "http"

    @field_validator("dns")
    @classmethod
    def _name_and_port(cls, value: str) -> str:
        name, _, port = value.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected NAME:PORT, got {value!r}")
        return value

    @property
    def name(self) -> str:
        return self.dns.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.dns.rpartition(":")[2])


def _entry_kind(value: Any) -> str:
    return _DNS_TAG if isinstance(value, dict) and "dns" in value else _URL_TAG


# A worker entry is a URL or a DNS name; the tags only steer validation (they are left out of error locations).
_URL_TAG, _DNS_TAG = "(by url)", "(by dns)"
PrefillEntry = Annotated[Annotated[PrefillWorkerConfig, Tag(_URL_TAG)] | Annotated[DnsWorkersConfig, Tag(_DNS_TAG)],
                         Discriminator(_entry_kind)]
DecodeEntry = Annotated[Annotated[DecodeWorkerConfig, Tag(_URL_TAG)] | Annotated[DnsWorkersConfig, Tag(_DNS_TAG)],
                        Discriminator(_entry_kind)]


def _validate_worker_url(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port  # raises for a port out of range or not a number
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or port == 0:
        raise ValueError(f"expected an http(s) URL with a host and a valid port, got {url!r}")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"expected a bare http(s)://host:port URL, got {url!r}")
    return url.rstrip("/")


PolicyName = Literal["round_robin", "random", "least_outstanding", "power_of_two", "prefix_affinity",
                     "session_affinity", "cache_aware", "kv_headroom"]


class RoutingConfig(_Strict):
    """How a model's requests are spread over its workers (see routing/policies/)."""

    prefill_policy: PolicyName = "round_robin"
    decode_policy: PolicyName = "round_robin"
    affinity_header: str | None = Field(None, description="session_affinity: the header whose value keeps a session "
                                                          "on one worker")
    prefix_tokens: int = Field(64, ge=1, le=4096, description="prefix_affinity: leading token ids hashed")
    load_poll_s: float = Field(2.0, gt=0, description="power_of_two: how often engines' loads are read; a reading "
                                                       "older than 3 intervals is not trusted")
    retries: int = Field(2, ge=0, le=5, description="other pairs tried when a worker provably never got the request")
    cache_aware_tokens: int = Field(65536, ge=64, le=1 << 20, description="cache_aware: leading prompt tokens "
                                                                          "matched against the prefills' caches")
    cache_aware_index_bytes: int = Field(1 << 30, ge=1 << 20, description="cache_aware: the most one prefill's "
                                         "cache index may take (~256 B an engine page, shared by its ranks), "
                                         "whatever pool the engine claims")
    kv_events: Literal["auto", "per_block", "off"] = Field(
        "auto", description="cache_aware: follow the prefills' KV events where they publish them (a worker's "
        "kv_events, else its /server_info) for what they say of the whole cache (a restart, a clear); per_block: "
        "also lower a prediction for each block an engine reports evicted (sharper, but SGLang's events do not say "
        "whose copy went: README lists what another tenant's traffic can then change in a tenant's prediction); "
        "off: route by what kvgate sent alone")

    @model_validator(mode="after")
    def _session_needs_header(self) -> RoutingConfig:
        if "session_affinity" in (self.prefill_policy, self.decode_policy) and not self.affinity_header:
            raise ValueError("session_affinity needs affinity_header")
        if self.decode_policy == "cache_aware":
            raise ValueError("cache_aware is a prefill_policy (a decode computes no prompt)")
        if self.prefill_policy == "kv_headroom":
            raise ValueError("kv_headroom is a decode_policy (it weighs the decode preallocation queue)")
        return self

    @property
    def reads_engine_loads(self) -> bool:
        """Whether a policy needs the engines' own `/v1/loads`."""
        return bool({"power_of_two", "kv_headroom"} & {self.prefill_policy, self.decode_policy})

    @property
    def needs_prompt_sizes(self) -> bool:
        """Whether a policy routes by the prompt's token ids or sizes (`RouteKey.prompt`)."""
        return self.prefill_policy == "cache_aware" or self.decode_policy == "kv_headroom"

    @field_validator("affinity_header")
    @classmethod
    def _lowercase_header(cls, name: str | None) -> str | None:
        return name.lower() if name else name


class LimitsConfig(_Strict):
    """Backpressure per model: beyond it requests wait in a bounded queue, then get 503 with Retry-After."""

    max_inflight_per_worker: int | None = Field(1024, ge=1, description="requests in flight on one engine (null: "
                                                                         "no limit)")
    max_queue: int = Field(1024, ge=0, description="requests waiting for a worker with room")
    queue_timeout_s: float = Field(30.0, gt=0, description="longest wait in that queue")
    # What the gateway reads of an engine's answer: a cap is an engine's fault (502, counted against its breaker).
    # Prompt logprobs take ~26-40 bytes a token (more with input top logprobs), so 32 MiB holds a prefill's answer
    # with the logprobs of a ~1M-token prompt; a /generate event is cumulative: 8 MiB holds ~200k output tokens with
    # their logprobs. Raise them for top logprobs on long prompts or outputs.
    engine_event_bytes: int = Field(8 << 20, ge=1024, description="one streamed engine event (decode's)")
    engine_answer_bytes: int = Field(32 << 20, ge=1024, description="one whole engine answer (prefill's body; "
                                     "decode's, for a client that does not stream)")


class BreakerConfig(_Strict):
    """Per worker, hence per leg: a decode failure never counts against a prefill worker."""

    failure_threshold: int = Field(5, ge=1, description="failures in a row that open the breaker")
    success_threshold: int = Field(2, ge=1, description="probe successes in a row that close it")
    open_s: float = Field(10.0, gt=0, description="how long it stays open before a probe")


CheckAction = Literal["warn", "refuse"]


class DeploymentChecksConfig(_Strict):
    """The incident's deployment gate beyond the pool, per worker on every read (see README, "Deployment checks").
    refuse: a failing worker stays out of rotation (and a model left without a role is refused); warn: reported."""

    version_skew: CheckAction = Field("warn", description="prefill and decode on different SGLang versions")
    transfer_backend: CheckAction = Field("refuse", description="fake, unknown, or different on the two roles")
    role_settings_match: CheckAction = Field("refuse", description="KV checksum / decode allocation policy differ")
    deferred_kv_release: CheckAction = Field("warn", description="deferred decode KV release off or absent")
    transfer_batch_bound: CheckAction = Field("warn", description="Mooncake transfer batches unbounded (prefill)")
    release_timeout: CheckAction = Field("warn", description="decode's release timeout below transfer_timeout_s")
    metrics_enabled: CheckAction = Field("warn", description="engine started without --enable-metrics")
    engine_chat_rendering: CheckAction = Field("refuse", description="engine renders chats with settings kvgate "
                                               "does not apply: --default-chat-template-kwargs, "
                                               "--completion-template, --chat-template unless the model's "
                                               "chat_template is set")
    require_verified_transfer_settings: bool = Field(False, description="treat unverified (not exposed) as failed")
    require_kv_checksum: bool = Field(False, description="every worker must run with the KV checksum on")
    transfer_timeout_s: float = Field(30.0, gt=0, description="the longest KV transfer you expect (Mooncake's "
                                                               "MC_TRANSFER_TIMEOUT, which SGLang does not expose)")


class IntegrityConfig(_Strict):
    """Guards on output that looks like success (the incident's leak answered 200, fast)."""

    max_prefill_tokens_per_s: float | None = Field(None, gt=0, description="the fastest prefill this model's engines "
                                                                           "can do; a first token sooner than "
                                                                           "prompt_tokens / this is implausible")
    min_prompt_tokens: int = Field(1024, ge=1, description="shorter prompts are not judged (noise dominates)")
    strict: bool = Field(False, description="an implausible first token fails the request (502) before any output "
                                            "is released; otherwise it is counted and logged")
    provenance_sample: float = Field(0.0, ge=0, le=1, description="share of requests whose answer is checked for "
                                                                  "text only one other tenant recently sent")
    provenance_window: int = Field(1_000_000, ge=1000, description="n-gram hashes of sampled prompts kept per model")
    canary_interval_s: float | None = Field(None, gt=0, description="run the canary probes this often (null: never)")
    canary_near_limit: bool = Field(False, description="also probe at limit−1 and limit (each costs a full prefill "
                                                       "of that size)")


class HealthConfig(_Strict):
    path: str = Field("/server_info", pattern=r"^/", description="checked every interval; /server_info is read and "
                                                                  "judged anyway")
    interval_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(5.0, gt=0)
    failure_threshold: int = Field(3, ge=1)
    success_threshold: int = Field(2, ge=1)


class ModelConfig(_Strict):
    name: str = Field(min_length=1)
    tokenizer: Path
    chat_template: Path | None = None
    context_length: int = Field(gt=1)
    max_prompt_tokens: int | None = Field(None, gt=0)
    default_max_tokens: int = Field(256, gt=0)
    max_output_tokens: int | None = Field(None, gt=0, description="cap on a client's max_tokens")
    on_pool_mismatch: Literal["refuse", "clamp"] = "refuse"
    min_engine_version: str = "0.5.22"
    on_old_engine: Literal["warn", "refuse"] = "warn"
    release: Literal["verified", "immediate"] = Field(
        "verified", description="verified: no output before every engine's prompt count equals the gateway's")
    chat_template_kwargs: list[str] | None = Field(
        None, description="keys a client may send in chat_template_kwargs (default: the template's own variables)")
    routing: RoutingConfig = RoutingConfig()
    limits: LimitsConfig = LimitsConfig()
    circuit_breaker: BreakerConfig = BreakerConfig()
    deployment_checks: DeploymentChecksConfig = DeploymentChecksConfig()
    integrity: IntegrityConfig = IntegrityConfig()
    health: HealthConfig | None = Field(None, description="this model's workers' health checks (default: the "
                                                          "top-level health block)")
    prefill: list[PrefillEntry] = Field(min_length=1)
    decode: list[DecodeEntry] = Field(min_length=1)

    def static_workers(self, role: Literal["prefill", "decode"]) -> list[PrefillWorkerConfig | DecodeWorkerConfig]:
        return [w for w in (self.prefill if role == "prefill" else self.decode) if not isinstance(w, DnsWorkersConfig)]

    def dns_workers(self, role: Literal["prefill", "decode"]) -> list[DnsWorkersConfig]:
        return [w for w in (self.prefill if role == "prefill" else self.decode) if isinstance(w, DnsWorkersConfig)]

    @property
    def kv_events_endpoints(self) -> dict[str, KvEventsConfig]:
        """Prefill workers' KV events as configured, by URL (others: as their engines report them)."""
        return {w.url: w.kv_events for w in self.prefill if isinstance(w, PrefillWorkerConfig) and w.kv_events}

    @property
    def configured_prompt_limit(self) -> int:
        """Largest prompt the configuration alone allows: min(max_prompt_tokens, context_length - 1)."""
        limit = self.context_length - 1
        if self.max_prompt_tokens is not None:
            limit = min(limit, self.max_prompt_tokens)
        return limit

    @model_validator(mode="after")
    def _output_fits_context(self) -> ModelConfig:
        if self.default_max_tokens >= self.context_length:
            raise ValueError("default_max_tokens must be smaller than context_length")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, names: list[str] | None) -> list[str] | None:
        forbidden = sorted(set(names or ()) & NOT_TEMPLATE_VARIABLES)
        if forbidden:
            raise ValueError(f"{forbidden} change how the engine renders or tokenizes, not what the template "
                             "reads; they cannot be allowed")
        return names


class GateConfig(_Strict):
    """How workers' KV-pool telemetry is checked at startup (see routing.gate)."""

    startup_timeout_s: float = Field(30.0, gt=0)
    start_anyway: bool = Field(False, description="serve other models when one fails the gate; it answers 503")


class AdminConfig(_Strict):
    token_env: str = Field("KVGATE_ADMIN_TOKEN", min_length=1, description="environment variable holding the bearer "
                                                                          "token of /admin/*; unset or empty: "
                                                                          "the admin API is off")


class DiscoveryConfig(_Strict):
    nameservers: list[str] = Field(default_factory=list, description="HOST or HOST:PORT resolvers for dns workers "
                                                                      "(empty: the system's resolv.conf)")


class LoggingConfig(_Strict):
    format: Literal["text", "json"] = Field("text", description="json: one object per line")
    access_log: bool = Field(True, description="one line per client request (kvgate.access)")


class TracingConfig(_Strict):
    """OpenTelemetry traces: one span per request, children for admission, routing, prefill and decode."""

    enabled: bool = False
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/"
                                                        "traces (null: spans are made but not exported)")
    service_name: str = "kvgate"
    sample_ratio: float = Field(1.0, ge=0, le=1, description="of traces this gateway starts; a client's sampled "
                                                             "traceparent is followed")


class ShutdownConfig(_Strict):
    grace_s: float = Field(30.0, ge=0, description="on SIGTERM, how long requests in flight may take to finish")


class StateConfig(_Strict):
    """Where the state several replicas share lives: this process (memory) or Redis."""

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = Field(None, pattern=r"^rediss?://", description="redis://HOST:PORT/DB")
    redis_sentinels: list[str] = Field(default_factory=list, description="HOST:PORT of each Sentinel")
    redis_service: str | None = Field(None, description="the primary's name in Sentinel")
    on_redis_down: Literal["open", "closed"] = Field("open", description="open: carry on with this replica's own "
                                                     "limits and load; closed: answer 503 until Redis is back")
    timeout_s: float = Field(0.25, gt=0, le=5, description="longest wait for one Redis call")
    lease_s: float = Field(30.0, gt=0, description="a replica that stops renewing its lease counts no more load "
                           "after this long")
    sync_interval_s: float = Field(0.25, gt=0, le=5, description="how often a replica publishes its load and "
                                   "reads the fleet's (kill switches reach it within this, or at once by pub/sub)")

    @field_validator("redis_sentinels")
    @classmethod
    def _host_ports(cls, sentinels: list[str]) -> list[str]:
        for entry in sentinels:
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{entry!r} is not HOST:PORT")
        return sentinels

    @model_validator(mode="after")
    def _redis_named(self) -> StateConfig:
        if self.backend == "redis" and not self.redis_url and not self.redis_sentinels:
            raise ValueError("backend redis needs redis_url, or redis_sentinels and redis_service")
        if self.redis_sentinels and not self.redis_service:
            raise ValueError("redis_sentinels needs redis_service (the primary's name in Sentinel)")
        return self


class AuthConfig(_Strict):
    required: bool = Field(False, description="requests without a known API key get 401")
    cache_salt_secret_env: str = Field("KVGATE_CACHE_SALT_SECRET", min_length=1, description="environment "
                                       "variable holding the key of the tenants' prefix-cache salts (unset: one "
                                       "the replicas share through the state backend)")


class TenantLimitsConfig(_Strict):
    requests_per_min: int | None = Field(None, gt=0)
    prompt_tokens_per_min: int | None = Field(None, gt=0, description="charged with kvgate's own count")
    output_tokens_per_min: int | None = Field(None, gt=0, description="charged as they are produced")
    max_concurrent: int | None = Field(None, gt=0)
    body_bytes_per_min: int | None = Field(None, gt=0, description="request body bytes, charged once the body is in "
                                                                  "and before it is parsed, whatever the answer")


class TenantConfig(_Strict):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    api_keys: list[str] = Field(default_factory=list, description='"sha256:<hex of the key>" each')
    limits: TenantLimitsConfig = TenantLimitsConfig()
    cache_group: str | None = Field(None, min_length=1, description="tenants naming the same group share a "
                                    "prefix-cache salt (default: the tenant's own)")

    @field_validator("api_keys")
    @classmethod
    def _hashed(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", key):
                raise ValueError("api_keys are stored hashed: \"sha256:\" and 64 lowercase hex digits "
                                 "(e.g. printf %s \"$KEY\" | sha256sum)")
        return keys


class GatewayConfig(_Strict):
    listen: ListenConfig = ListenConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    gate: GateConfig = GateConfig()
    health: HealthConfig = HealthConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    admin: AdminConfig = AdminConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    logging: LoggingConfig = LoggingConfig()
    tracing: TracingConfig = TracingConfig()
    state: StateConfig = StateConfig()
    auth: AuthConfig = AuthConfig()
    tenants: list[TenantConfig] = Field(default_factory=list)
    max_body_bytes: int = Field(64 * 2**20, gt=0)
    max_header_bytes: int = Field(64 * 1024, gt=0, description="request line plus all headers")
    max_headers: int = Field(100, gt=0)
    max_connections: int = Field(1024, gt=0, description="open client connections; beyond it new requests get 503")
    max_connections_per_client: int | None = Field(
        None, gt=0, description="open connections one client address may hold (default: a quarter of "
                                "max_connections; behind a proxy that hides client addresses, max_connections)")
    max_connections_per_key: int | None = Field(
        None, gt=0, description="open connections one API key may hold from any addresses (default: a quarter of "
                                "max_connections)")
    token_cache_bytes: int = Field(64 * 2**20, ge=0)
    admission_workers: int | None = Field(None, ge=1, description="processes that admit large bodies off the event "
                                          "loop, shared fairly by tenant (default: the cores this process may use)")
    models: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_model_names(self) -> GatewayConfig:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique, repeated: {duplicates}")
        tenants = [t.name for t in self.tenants]
        if len(set(tenants)) != len(tenants):
            raise ValueError("tenant names must be unique")
        keys = [k for t in self.tenants for k in t.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key may belong to one tenant only")
        return self

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def connections_per_client(self) -> int:
        return self.max_connections_per_client or max(1, self.max_connections // 4)

    @property
    def connections_per_key(self) -> int:
        return self.max_connections_per_key or max(1, self.max_connections // 4)

    @property
    def admission_processes(self) -> int:
        """`admission_workers`, or one per core this process may run on (with two or more, a tenant flooding them
        with large bodies always leaves one to the others)."""
        return self.admission_workers or max(1, len(os.sched_getaffinity(0)))

    def health_of(self, model: ModelConfig) -> HealthConfig:
        return model.health or self.health


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML file. Relative tokenizer/template paths resolve against the working directory,
    then against the file's own folder."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    try:
        config = GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_describe(exc)}") from exc
    return _resolve_paths(config, path.parent)


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"] if part not in (_URL_TAG, _DNS_TAG)) or "(top level)"
        problems.append(f"{key}: {error['msg']}")
    return "; ".join(problems)


def _resolve_paths(config: GatewayConfig, base: Path) -> GatewayConfig:
    models = []
    for index, model in enumerate(config.models):
        updates: dict[str, Path] = {}
        for key in ("tokenizer", "chat_template"):
            value: Path | None = getattr(model, key)
            if value is None:
                continue
            resolved = _existing(value, base)
            if resolved is None:
                raise ConfigError(f"models.{index}.{key}: file not found: {value}")
            updates[key] = resolved
        models.append(model.model_copy(update=updates))
    return config.model_copy(update={"models": models})


def _existing(path: Path, base: Path) -> Path | None:
    for candidate in (path, base / path):
        if candidate.is_file():
            return candidate.resolve()
    return None
