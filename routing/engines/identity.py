"""The facts an engine reports in `/server_info` that the KV-pool gate judges: together they identify the engine
process as far as admission is concerned. Two readings with equal identities admit the same prompts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


def version_tuple(version: str) -> tuple[int, ...]:
    """"0.5.22rc1+cu128" → (0, 5, 22)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


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
    settings: TransferSettings = TransferSettings()


def parse_identity(info: Any) -> EngineIdentity:
    """Read an identity from a `/server_info` body; KeyError/TypeError/ValueError when it is unusable."""
    if not isinstance(info, dict):
        raise TypeError("server info is not a JSON object")
    context = info.get("context_length")
    return EngineIdentity(
        pool_tokens=int(info["max_total_num_tokens"]),
        max_req_input_len=int(info["max_req_input_len"]),
        page_size=int(info.get("page_size") or 1),
        version=str(info.get("version", "unknown")),
        disaggregation_mode=str(info.get("disaggregation_mode", "null")),
        served_model_name=info.get("served_model_name"),
        tokenizer_path=info.get("tokenizer_path"),
        launch_context_length=int(context) if context is not None else None,
        reserved_decode_tokens=int(info.get("num_reserved_decode_tokens") or 512),
        settings=_transfer_settings(info),
    )


def _transfer_settings(info: dict[str, Any]) -> TransferSettings:
    checksum, policy, metrics = (info.get(key) for key in ("disaggregation_enable_kv_checksum",
                                                           "disaggregation_decode_allocation_policy", "enable_metrics"))
    env: tuple[tuple[str, str], ...] | None = None
    for state in info.get("internal_states") or ():
        if isinstance(state, dict) and isinstance(state.get("env_vars"), dict):
            env = tuple(sorted((str(k), str(v)) for k, v in state["env_vars"].items()))
            break
    backend = info.get("disaggregation_transfer_backend")
    return TransferSettings(backend=str(backend) if backend is not None else None,
                            kv_checksum=checksum if isinstance(checksum, bool) else None,
                            decode_allocation_policy=str(policy) if policy is not None else None,
                            metrics_enabled=metrics if isinstance(metrics, bool) else None, env_vars=env)
