"""Client request bodies → the reduced request kvgate counts and forwards.

Each endpoint has an allowlist: only the fields named here reach an engine, in the form validated here, so nothing
a client sends reaches an engine's internal fields (`rid`, `bootstrap_*`, `data_parallel_rank`, …). Fields that would
change what the engine computes but that kvgate cannot forward exactly are refused with 400, never dropped silently.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, cast

import orjson

from gateway.admission.chat import ChatPrompt, ChatSettings, free_form_problem, parse_chat
from gateway.errors import GatewayError, bad_request

Route = Literal["/generate", "/v1/chat/completions", "/v1/completions"]

_OPENAI_SHARED = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logprobs", "top_logprobs", "logit_bias", "user", "ignore_eos", "skip_special_tokens",
    "min_tokens", "stop_token_ids", "no_stop_trim", "regex", "ebnf", "json_schema", "response_format",
    "spaces_between_special_tokens",
})
_CHAT_FIELDS = _OPENAI_SHARED | {"separate_reasoning", "stream_reasoning", "parallel_tool_calls"}
_COMPLETION_FIELDS = _OPENAI_SHARED | {"echo"}
_GENERATE_FIELDS = frozenset({
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
})
_SAMPLING_FIELDS = frozenset({
    "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "json_schema", "regex", "ebnf", "structural_tag", "sampling_seed", "logit_bias",
})
# They change what the engine computes (adapters, inputs, hooks) and kvgate does not forward them.
_REFUSED_FIELDS = ("lora_path", "session_params", "custom_logit_processor", "custom_params", "return_hidden_states",
                   "input_embeds", "image_data", "video_data", "audio_data", "modalities")
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# Above this a client's token count is absurd for any model; checked before the model's own, tighter limit.
MAX_TOKENS_CEILING = 1 << 31
# Logprobs an engine computes and sends for every output token: bounded, as OpenAI bounds top_logprobs (20), with
# room for /generate's research uses.
MAX_TOP_LOGPROBS = 256
MAX_TOKEN_IDS_LOGPROB = 4096


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """Raw text the engine tokenizes with the tokenizer's defaults (special tokens added)."""

    text: str


@dataclass(frozen=True, slots=True)
class IdsPrompt:
    """Token ids the engine takes as they are."""

    ids: list[Any]  # validated against the vocabulary at admission (after the cheap length check)


Prompt = TextPrompt | IdsPrompt | ChatPrompt


@dataclass(frozen=True, slots=True)
class UsageOptions:
    """What the client asked for in `stream_options` (the gateway asks the decode engine for more)."""

    include_usage: bool = False
    continuous: bool = False


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A validated request: the reduced engine fields (prompt included, gateway-owned fields excluded) and what
    admission must count."""

    route: Route
    model: str | None
    stream: bool
    fields: dict[str, Any]
    prompt: Prompt
    max_tokens: int | None
    usage: UsageOptions
    # The client's cache_salt (or extra_key): never forwarded as sent; kvgate sends its tenant's keyed salt instead
    # (gateway.tenancy.salts), of which this is one input.
    cache_salt: str | None = None

    @property
    def prompt_param(self) -> str:
        if isinstance(self.prompt, ChatPrompt):
            return "messages"
        return "prompt" if self.route == "/v1/completions" else ("text" if isinstance(self.prompt, TextPrompt)
                                                                 else "input_ids")


def decode_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise bad_request("request body must be a JSON object")
    return parsed


def requested_model(route: Route, data: dict[str, Any]) -> str | None:
    """The model a body names (required on the OpenAI routes, optional on /generate)."""
    model = data.get("model")
    if model is None and route == "/generate":
        return None
    if not isinstance(model, str) or not model:
        raise bad_request("model is required and must be a string", param="model")
    return model


def parse_request(route: Route, data: dict[str, Any], chat: ChatSettings) -> ClientRequest:
    for key in _REFUSED_FIELDS:
        if data.get(key) is not None:
            raise bad_request(f"{key} is not supported by this gateway", param=key)
    if route == "/v1/chat/completions":
        request = _parse_chat(data, chat)
    elif route == "/v1/completions":
        request = _parse_completion(data)
    else:
        request = _parse_generate(data)
    salts = []
    for key in ("cache_salt", "extra_key"):  # SGLang's two names for the prefix-cache namespace
        salt = data.get(key)
        if salt is None:
            continue
        if not isinstance(salt, str) or len(salt) > 256:
            raise bad_request(f"{key} must be a string of at most 256 characters", param=key)
        salts.append(salt)
    if not salts:
        return request
    return dataclasses.replace(request, cache_salt="\0".join(salts))


def _parse_chat(data: dict[str, Any], settings: ChatSettings) -> ClientRequest:
    fields = _allowed(data, _CHAT_FIELDS)
    _check_openai_common(data, fields)
    prompt = parse_chat(data, settings)
    fields.update(prompt.forwarded())
    max_tokens = _optional_count(data, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_count(data, "max_tokens")
    return ClientRequest("/v1/chat/completions", requested_model("/v1/chat/completions", data), _stream(data),
                         fields, prompt, max_tokens, _usage_options(data))


def _parse_completion(data: dict[str, Any]) -> ClientRequest:
    fields = _allowed(data, _COMPLETION_FIELDS)
    _check_openai_common(data, fields)
    if data.get("suffix"):
        # With a server-side completion template the suffix becomes part of the prompt: not countable here.
        raise bad_request("suffix is not supported by this gateway", param="suffix")
    if data.get("echo") and data.get("logprobs"):
        # The prompt's logprobs: SGLang's OpenAI route never computes them ("Echo is not compatible with logprobs",
        # serving_completions._convert_to_internal_request, 0.5.8 and 0.5.23), and in PD only the prefill could. An
        # answer without them would silently differ from what was asked: refused, with the way that works.
        raise bad_request("echo with logprobs (the prompt's logprobs) is not available on /v1/completions with "
                          "prefill/decode disaggregation; use POST /generate with return_logprob: true and "
                          "logprob_start_len: 0, or drop one of echo and logprobs", param="echo")
    prompt_value = data.get("prompt")
    prompt: Prompt
    if isinstance(prompt_value, list) and len(prompt_value) == 1 and isinstance(prompt_value[0], str):
        prompt_value = prompt_value[0]
    if prompt_value == "":  # as SGLang's serving_completions._validate_request: "Prompt cannot be empty"
        raise bad_request("prompt cannot be empty", param="prompt")
    if isinstance(prompt_value, str):
        prompt = TextPrompt(prompt_value)
    elif isinstance(prompt_value, list) and prompt_value and not isinstance(prompt_value[0], (str, list)):
        prompt = IdsPrompt(prompt_value)
    elif isinstance(prompt_value, list) and len(prompt_value) > 1:
        raise bad_request("batched prompts are not supported; send one prompt per request", param="prompt")
    else:
        raise bad_request("prompt must be a string or an array of token ids", param="prompt")
    fields["prompt"] = prompt.text if isinstance(prompt, TextPrompt) else prompt.ids
    return ClientRequest("/v1/completions", requested_model("/v1/completions", data), _stream(data), fields, prompt,
                         _optional_count(data, "max_tokens"), _usage_options(data))


def _parse_generate(data: dict[str, Any]) -> ClientRequest:
    fields = _allowed(data, _GENERATE_FIELDS)
    _check_logprob_fields(fields)
    text, ids = data.get("text"), data.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("exactly one of text or input_ids is required", param="text")
    prompt: Prompt
    if text is not None:
        if not isinstance(text, str):
            raise bad_request("text must be a string (batched requests are not supported)", param="text")
        prompt = TextPrompt(text)
        fields["text"] = text
    else:
        if not isinstance(ids, list) or not ids or isinstance(ids[0], list):
            raise bad_request("input_ids must be a non-empty array of token ids (batches are not supported)",
                              param="input_ids")
        prompt = IdsPrompt(ids)
        fields["input_ids"] = ids
    sampling = data.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise bad_request("sampling_params must be an object", param="sampling_params")
    if sampling.get("n", 1) != 1:
        raise bad_request("n > 1 is not supported", param="sampling_params.n")
    max_tokens = _optional_count(sampling, "max_new_tokens", minimum=0)
    sampling = _allowed(sampling, _SAMPLING_FIELDS)
    _check_values(sampling, "sampling_params.")
    fields["sampling_params"] = sampling
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", param="model")
    return ClientRequest("/generate", model, _stream(data), fields, prompt, max_tokens, UsageOptions())


def _check_logprob_fields(fields: dict[str, Any]) -> None:
    """Exactly the types SGLang's GenerateReqInput declares. Its pydantic model would coerce `1` or `"yes"` to
    true, while kvgate (which merges prefill's prompt logprobs when `return_logprob` is true) would read them as
    false: the answer would silently differ from what was asked, so they are refused instead."""
    for key in ("return_logprob", "return_text_in_logprobs"):
        if key in fields and not isinstance(fields[key], bool):
            raise bad_request(f"{key} must be a boolean", param=key)
    start = fields.get("logprob_start_len")
    if start is not None and (not _is_int(start) or start < -1):
        raise bad_request("logprob_start_len must be an integer ≥ -1", param="logprob_start_len")
    top = fields.get("top_logprobs_num")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad_request(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
    ids = fields.get("token_ids_logprob")
    if ids is not None and (not isinstance(ids, list) or len(ids) > MAX_TOKEN_IDS_LOGPROB
                            or not all(_is_int(token) for token in ids)):
        raise bad_request(f"token_ids_logprob must be an array of at most {MAX_TOKEN_IDS_LOGPROB} token ids "
                          "(batches are not supported)", param="token_ids_logprob")


def _allowed(data: dict[str, Any], fields: frozenset[str]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if key in fields and value is not None}


def _check_openai_common(data: dict[str, Any], fields: dict[str, Any]) -> None:
    if data.get("n", 1) not in (1, None):
        raise bad_request("n > 1 is not supported", param="n")
    _check_values(fields, "")


def _usage_options(data: dict[str, Any]) -> UsageOptions:
    options = data.get("stream_options")
    if options is None:
        return UsageOptions()
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    return UsageOptions(include_usage=options.get("include_usage") is True,
                        continuous=options.get("continuous_usage_stats") is True)


def _check_values(body: dict[str, Any], prefix: str) -> None:
    for key in _NUMBER_FIELDS:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(f"{prefix}{key} must be a finite number", param=prefix + key)
        if value < 0 and key in ("temperature", "top_p", "min_p"):
            raise bad_request(f"{prefix}{key} must not be negative", param=prefix + key)
    top_k = body.get("top_k")
    if top_k is not None and not _is_int(top_k):
        raise bad_request(f"{prefix}top_k must be an integer", param=prefix + "top_k")
    for key, value in body.items():
        problem = free_form_problem(value) if isinstance(value, (dict, list, str)) else None
        if problem:
            raise bad_request(f"{prefix}{key} {problem}", param=prefix + key)


def _stream(data: dict[str, Any]) -> bool:
    stream = data.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", param="stream")
    return stream


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_count(body: dict[str, Any], key: str, *, minimum: int = 1) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"{key} must be an integer", param=key)
    if value < minimum:
        raise bad_request(f"{key} must be at least {minimum}, got {value}", param=key)
    if value > MAX_TOKENS_CEILING:
        raise bad_request(f"{key} is absurdly large ({value})", param=key)
    return cast(int, value)


def reject_unknown_model(name: str | None, served: list[str]) -> GatewayError:
    return GatewayError(404, f"model {name!r} is not served here; served models: {', '.join(served)}",
                        type="invalid_request_error", code="model_not_found", param="model")
