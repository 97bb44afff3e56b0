"""Client request bodies → what the engines may see.

Each endpoint has an allowlist: only the fields named here are forwarded, so nothing a client sends reaches an
engine's internal fields (`rid`, `bootstrap_*`, `data_parallel_rank`, …). Values are type-checked so that a bad one
is a 400 from the gateway, never a forwarded request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.errors import GatewayError, bad_request

Route = Literal["/generate", "/v1/chat/completions", "/v1/completions"]

_OPENAI_SHARED = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "logit_bias", "user",
    "ignore_eos", "skip_special_tokens", "min_tokens", "stop_token_ids", "no_stop_trim", "regex", "ebnf",
    "json_schema", "response_format", "spaces_between_special_tokens",
})
_CHAT_FIELDS = _OPENAI_SHARED | {
    "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "separate_reasoning", "stream_reasoning", "reasoning_effort", "continue_final_message",
}
_COMPLETION_FIELDS = _OPENAI_SHARED | {"prompt", "echo", "suffix"}
_GENERATE_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_text_in_logprobs",
})
_SAMPLING_FIELDS = frozenset({
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "json_schema", "regex", "ebnf", "structural_tag",
    "sampling_seed", "logit_bias",
})
_UNSUPPORTED_INPUTS = ("input_embeds", "image_data", "video_data", "audio_data")
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
# Above this a client's token count is absurd for any model; checked before the model's own, tighter limit.
_MAX_TOKENS_CEILING = 1 << 31


@dataclass(slots=True)
class ClientRequest:
    """A validated request: the engine body (without gateway-owned fields) and what admission must count."""

    route: Route
    model: str | None
    stream: bool
    body: dict[str, Any]
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None

    @property
    def add_special_tokens(self) -> bool:
        # SGLang tokenizes raw prompts with the tokenizer's default and rendered chats with add_special_tokens=False.
        return self.messages is None


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


def parse_request(route: Route, raw: bytes) -> ClientRequest:
    data = decode_json_object(raw)
    if route == "/v1/chat/completions":
        return _parse_chat(data)
    if route == "/v1/completions":
        return _parse_completion(data)
    return _parse_generate(data)


def _parse_chat(data: dict[str, Any]) -> ClientRequest:
    body = _allowed(data, _CHAT_FIELDS)
    _check_openai_common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of message objects", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{index}] must be an object with a string role", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"messages[{index}].content must be a string or an array of parts", param="messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools must be an array", param="tools")
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
    max_tokens = _optional_count(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_count(body, "max_tokens")
    body.pop("max_completion_tokens", None)
    return ClientRequest(
        route="/v1/chat/completions", model=_model(body), stream=_stream(body), body=body,
        messages=_template_messages(messages),
        tools=tools if tools and body.get("tool_choice") != "none" else None,
        template_kwargs=template_kwargs, max_tokens=max_tokens,
    )


def _parse_completion(data: dict[str, Any]) -> ClientRequest:
    body = _allowed(data, _COMPLETION_FIELDS)
    _check_openai_common(body)
    prompt = body.get("prompt")
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        text = prompt[0]
    elif isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("batched prompts are not supported; send one prompt per request", param="prompt")
    else:
        raise bad_request("prompt must be a string or an array of token ids", param="prompt")
    if ids is not None:
        _check_token_ids(ids, "prompt")
    return ClientRequest(route="/v1/completions", model=_model(body), stream=_stream(body), body=body,
                         prompt_text=text, prompt_ids=ids, max_tokens=_optional_count(body, "max_tokens"))


def _parse_generate(data: dict[str, Any]) -> ClientRequest:
    for key in _UNSUPPORTED_INPUTS:
        if data.get(key) is not None:
            raise bad_request(f"{key} is not supported by this gateway", param=key)
    body = _allowed(data, _GENERATE_FIELDS)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("exactly one of text or input_ids is required", param="text")
    if text is not None and not isinstance(text, str):
        raise bad_request("text must be a string (batched requests are not supported)", param="text")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
            raise bad_request("input_ids must be a non-empty array of token ids (batches are not supported)",
                              param="input_ids")
        _check_token_ids(ids, "input_ids")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise bad_request("sampling_params must be an object", param="sampling_params")
    sampling = _allowed(sampling, _SAMPLING_FIELDS)
    _check_numbers(sampling, "sampling_params.")
    if sampling.get("n", 1) != 1:
        raise bad_request("n > 1 is not supported", param="sampling_params.n")
    max_tokens = _optional_count(sampling, "max_new_tokens", minimum=0)
    body["sampling_params"] = sampling
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", param="model")
    return ClientRequest(route="/generate", model=model, stream=_stream(body), body=body, prompt_text=text,
                         prompt_ids=ids, max_tokens=max_tokens)


def _allowed(data: dict[str, Any], fields: frozenset[str]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if key in fields}


def _check_openai_common(body: dict[str, Any]) -> None:
    if body.get("n", 1) not in (1, None):
        raise bad_request("n > 1 is not supported", param="n")
    _check_numbers(body, "")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", param="stream_options")


def _check_numbers(body: dict[str, Any], prefix: str) -> None:
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


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required and must be a string", param="model")
    return model


def _stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
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
    if value > _MAX_TOKENS_CEILING:
        raise bad_request(f"{key} is absurdly large ({value})", param=key)
    return value


def _check_token_ids(ids: list[int], param: str) -> None:
    if any(t < 0 or t >= _MAX_TOKENS_CEILING for t in ids):
        raise bad_request(f"{param} holds a token id out of range", param=param)


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as SGLang hands them to the template: tool-call arguments given as JSON text become objects."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_parsed_arguments(call) for call in calls]}
        rendered.append(message)
    return rendered


def _parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = orjson.loads(function["arguments"])
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"tool call arguments are not valid JSON: {exc}", param="messages") from exc
    return {**call, "function": {**function, "arguments": arguments}}


def reject_unknown_model(name: str | None, served: list[str]) -> GatewayError:
    return GatewayError(404, f"model {name!r} is not served here; served models: {', '.join(served)}",
                        type="invalid_request_error", code="model_not_found", param="model")
