"""Reading SGLang's answers: an error or abort inside a 2xx, and the prompt counts an answer or event states."""

from __future__ import annotations

import re
from typing import Any, Literal

import orjson

from routing.engines.client import error_message
from routing.engines.errors import EngineBroken, EngineRejected, is_length_rejection

# Every place an event states a prompt count (a key: inside a JSON string every quote is escaped), whitespace
# before the colon included (valid JSON), with the value's raw text up to its end: a client's parser reads
# `7e1` as 70 and `7.9` as 7.9, so only a plain integer (or null: no count) is a count the gateway can verify.
PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*([^\s,}\]]*)')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
# Where a /generate event's prompt logprobs start (a key: inside a JSON string every quote is escaped).
INPUT_LOGPROBS = re.compile(rb'"input_token_logprobs":\s*\[')


def stated_prompt_counts(role: Literal["prefill", "decode"], data: bytes) -> list[int]:
    """Every prompt count `data` states, as a client's JSON parser reads it; EngineBroken for one that is not a plain
    integer (a fraction, an exponent, a string, an object: the gateway could not verify what the client reads)."""
    counts: list[int] = []
    for value in PROMPT_TOKENS.findall(data):
        if value.isdigit() or (value[:1] == b"-" and value[1:].isdigit()):  # -?\d+ (bytes: ASCII digits only)
            counts.append(int(value))
        elif value != b"null":
            raise EngineBroken(role, f"{role} stated a prompt count that is not an integer: {value[:40]!r}")
    return counts


def parse_result(role: Literal["prefill", "decode"], payload: bytes) -> dict[str, Any]:
    """The engine's JSON result; an error or abort inside a 2xx (SGLang 0.5.8 answers 200 for a prompt it
    swapped, and may answer 2xx in its OpenAI error shape) is a rejection."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise EngineBroken(role, f"{role} answered 2xx with a body that is not JSON") from exc
    if not isinstance(parsed, dict):
        raise EngineBroken(role, f"{role} answered with unexpected JSON")
    return check_result(role, parsed, payload)


def check_result(role: Literal["prefill", "decode"], parsed: dict[str, Any], payload: bytes) -> dict[str, Any]:
    """`parse_result` for a result already parsed (`payload`: its bytes, for the error's words)."""
    if "error" in parsed or parsed.get("object") == "error":
        message = error_message(payload)
        error = parsed.get("error", parsed)
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 502
        raise EngineRejected(role, f"{role} reported an error: {message}", status=status, detail=message)
    meta = parsed.get("meta_info")
    if isinstance(meta, dict):
        _raise_on_abort(role, meta.get("finish_reason"))
    choices = parsed.get("choices") or []
    if not isinstance(choices, list):
        raise EngineBroken(role, f"{role} answered with malformed choices")
    for choice in choices:
        if isinstance(choice, dict):
            _raise_on_abort(role, choice.get("finish_reason"))
    return parsed


def _raise_on_abort(role: Literal["prefill", "decode"], finish: Any) -> None:
    """An abort as a finish reason: SGLang's string "abort" on OpenAI routes, or its FINISH_ABORT object
    (`{"type": "abort", "message", "status_code"}`), native in meta_info and passed through in some OpenAI choices."""
    if finish == "abort":
        raise EngineRejected(role, f"{role} aborted the request", status=502)
    if isinstance(finish, dict) and finish.get("type") == "abort":
        message = str(finish.get("message") or "request aborted")
        code = finish.get("status_code")
        # Only an error status stands; an abort is never a success, whatever code it carries.
        status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 502
        raise EngineRejected(role, f"{role} aborted the request: {message}",
                             status=400 if is_length_rejection(message) else status, detail=message)


def reported_cached_tokens(route: str, result: Any) -> int | None:
    """Prompt tokens the engine took from its prefix cache: `meta_info.cached_tokens` on /generate,
    `usage.prompt_tokens_details.cached_tokens` on OpenAI routes."""
    if not isinstance(result, dict):
        return None
    if route == "/generate":
        meta = result.get("meta_info")
        value = meta.get("cached_tokens") if isinstance(meta, dict) else None
    else:
        usage = result.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def reported_prompt_tokens(route: str, result: Any) -> int | None:
    """The engine's own prompt count: `meta_info.prompt_tokens` on /generate, `usage.prompt_tokens` on OpenAI."""
    if not isinstance(result, dict):
        return None
    holder = result.get("meta_info") if route == "/generate" else result.get("usage")
    value = holder.get("prompt_tokens") if isinstance(holder, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
