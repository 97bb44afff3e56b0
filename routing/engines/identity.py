"""The facts an engine reports in `/server_info` that the KV-pool gate judges: together they identify the engine
process as far as admission is concerned. Two readings with equal identities admit the same prompts."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version


def version_tuple(version: str) -> tuple[int, ...]:
    """"0.5.22rc1+cu128" → (0, 5, 22)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def release_at_least(version: str, release: tuple[int, ...]) -> bool | None:
    """Whether `version` is that release or later; None for a pre-release or dev build of exactly that release, or a
    version that cannot be parsed (defaults that changed in it cannot be assumed)."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed.release[:len(release)] == release and (parsed.is_prerelease or parsed.is_devrelease):
        return None
    return parsed.release >= release


def same_release(a: str, b: str) -> bool:
    """Equal versions, a local build tag (+cu128) aside."""
    return a.split("+")[0].strip() == b.split("+")[0].strip()


@dataclass(frozen=True, slots=True)
class TransferSettings:
    """The PD transfer-safety settings `/server_info` reveals; None where the engine's version has no such field, or
    (`env_vars`) where the engine does not expose its environment (SGLANG_EXPOSE_OWN_ENV_VARS unset)."""

    backend: str | None = None                   # disaggregation_transfer_backend
    kv_checksum: bool | None = None              # disaggregation_enable_kv_checksum (0.5.22+)
    decode_allocation_policy: str | None = None  # disaggregation_decode_allocation_policy (0.5.22+)
    metrics_enabled: bool | None = None          # enable_metrics
    env_vars: tuple[tuple[str, str], ...] | None = None  # only those set explicitly; the rest are at their defaults


@dataclass(frozen=True, slots=True)
class RenderingSettings:
    """How the engine renders chats beyond its tokenizer's own template: a `--chat-template` or
    `--completion-template` of its own, and `--default-chat-template-kwargs` (0.5.22+; merged under each request's
    `chat_template_kwargs` in `OpenAIServingChat._process_messages`). None where not set."""

    chat_template: str | None = None
    completion_template: str | None = None
    default_chat_template_kwargs: str | None = None  # as JSON, keys sorted


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    pool_tokens: int            # max_total_num_tokens: the KV pool
    max_req_input_len: int      # the scheduler aborts prompts of this length or more
    page_size: int
    version: str
    disaggregation_mode: str    # "prefill" | "decode" | "null"
    served_model_name: str | None
    tokenizer_path: str | None
    launch_context_length: int | None  # --context-length as launched (null when the model's default applies)
    # A decode only schedules a prompt when prompt + max(this, max_new_tokens) fits its pool (prealloc queue).
    reserved_decode_tokens: int = 512
    # Server info's top level (rank 0), where a smaller rank sets `pool_tokens`; only read by the /metrics
    # cross-check, so not part of what the gate judges an identity by.
    rank0_pool_tokens: int | None = field(default=None, compare=False)
    settings: TransferSettings = TransferSettings()
    rendering: RenderingSettings = RenderingSettings()
    # --kv-events-config as the engine runs it (JSON; None: it publishes no KV events), and how many publishers:
    # one per attention data-parallel rank (ZmqEventPublisher, port + rank).
    kv_events_config: str | None = None
    event_ranks: int = 1


def parse_identity(info: Any) -> EngineIdentity:
    """Read an identity from a `/server_info` body; KeyError/TypeError/ValueError when it is unusable."""
    if not isinstance(info, dict):
        raise TypeError("server info is not a JSON object")
    context = info.get("context_length")
    rank0_pool = int(info["max_total_num_tokens"])
    pool_tokens, max_req_input_len = _smallest_rank(rank0_pool, int(info["max_req_input_len"]),
                                                    info.get("internal_states"))
    return EngineIdentity(
        pool_tokens=pool_tokens,
        max_req_input_len=max_req_input_len,
        page_size=int(info.get("page_size") or 1),
        version=str(info.get("version", "unknown")),
        disaggregation_mode=str(info.get("disaggregation_mode", "null")),
        served_model_name=info.get("served_model_name"),
        tokenizer_path=info.get("tokenizer_path"),
        launch_context_length=int(context) if context is not None else None,
        reserved_decode_tokens=int(info.get("num_reserved_decode_tokens") or 512),
        rank0_pool_tokens=rank0_pool,
        settings=_transfer_settings(info),
        rendering=_rendering_settings(info),
        kv_events_config=_kv_events_config(info.get("kv_events_config")),
        event_ranks=int(info.get("dp_size") or 1) if info.get("enable_dp_attention") else 1,
    )


def _smallest_rank(pool_tokens: int, max_req_input_len: int, states: Any) -> tuple[int, int]:
    """The pool and input limit of the smallest data-parallel rank. Server info's top level is rank 0's scheduler
    (`scheduler_info`); each rank's own scheduler reports its pool in `internal_states[i]` (SGLang:
    `memory_usage.token_capacity`; `max_total_num_tokens` where a rank states it) and aborts prompts by its own
    max_req_input_len = min(context - 1, pool - 1) - 5, which follows from its pool where it is not stated. A
    prompt may land on any rank, so the smallest bounds what the engine admits."""
    if not isinstance(states, list):
        return pool_tokens, max_req_input_len
    for state in states:
        if not isinstance(state, dict):
            continue
        usage = state.get("memory_usage")
        rank_pool = _count(state.get("max_total_num_tokens"))
        if rank_pool is None and isinstance(usage, dict):
            rank_pool = _count(usage.get("token_capacity"))
        rank_input = _count(state.get("max_req_input_len"))
        if rank_pool is not None:
            pool_tokens = min(pool_tokens, rank_pool)
            max_req_input_len = min(max_req_input_len, rank_pool - 1 - 5)
        if rank_input is not None:
            max_req_input_len = min(max_req_input_len, rank_input)
    return pool_tokens, max_req_input_len


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _kv_events_config(value: Any) -> str | None:
    """ServerArgs keep the flag's JSON string; a publisher of "null" (the default) publishes nothing."""
    if isinstance(value, str) and value.strip():
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
    elif isinstance(value, dict):
        parsed = value
    else:
        return None
    if not isinstance(parsed, dict) or parsed.get("publisher") in (None, "null"):
        return None
    return json.dumps(parsed, sort_keys=True)


def _rendering_settings(info: dict[str, Any]) -> RenderingSettings:
    chat, completion, defaults = (info.get(key) for key in ("chat_template", "completion_template",
                                                            "default_chat_template_kwargs"))
    return RenderingSettings(chat_template=str(chat) if chat else None,
                             completion_template=str(completion) if completion else None,
                             default_chat_template_kwargs=json.dumps(defaults, sort_keys=True, default=str)
                             if defaults else None)


# The environment variables the deployment checks read; only these are kept (an identity must not change with others).
CHECKED_ENV = ("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE",
               "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT",
               "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", "SGLANG_MOONCAKE_CUSTOM_MEM_POOL")
RANKS_DISAGREE = "<ranks disagree>"


def _transfer_settings(info: dict[str, Any]) -> TransferSettings:
    checksum, policy, metrics = (info.get(key) for key in ("disaggregation_enable_kv_checksum",
                                                           "disaggregation_decode_allocation_policy", "enable_metrics"))
    backend = info.get("disaggregation_transfer_backend")
    return TransferSettings(backend=str(backend) if backend is not None else None,
                            kv_checksum=checksum if isinstance(checksum, bool) else None,
                            decode_allocation_policy=str(policy) if policy is not None else None,
                            metrics_enabled=metrics if isinstance(metrics, bool) else None,
                            env_vars=_exposed_env(info.get("internal_states")))


def _exposed_env(states: Any) -> tuple[tuple[str, str], ...] | None:
    """The checked variables as every data-parallel rank exposes them; None unless every rank exposes its
    environment (SGLANG_EXPOSE_OWN_ENV_VARS=1); a variable the ranks disagree on reads RANKS_DISAGREE."""
    if not isinstance(states, list) or not states:
        return None
    ranks: list[dict[str, Any]] = [state["env_vars"] for state in states
                                   if isinstance(state, dict) and isinstance(state.get("env_vars"), dict)]
    if len(ranks) != len(states):
        return None
    merged = []
    for name in CHECKED_ENV:
        values = {str(env[name]) for env in ranks if env.get(name) is not None}
        present = len([env for env in ranks if env.get(name) is not None])
        if present == 0:
            continue
        merged.append((name, values.pop() if len(values) == 1 and present == len(ranks) else RANKS_DISAGREE))
    return tuple(merged)
