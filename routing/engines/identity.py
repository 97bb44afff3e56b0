"""The facts an engine reports in `/server_info` that the KV-pool gate judges: together they identify the engine
process as far as admission is concerned. Two readings with equal identities admit the same prompts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    )
