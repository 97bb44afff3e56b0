"""From a validated chat request to what SGLang hands its chat template, step by step as sglang's serving_chat.py.

`check_request` is `OpenAIServingChat._validate_request`; `build_prompt` covers `_convert_to_internal_request`,
`_process_messages` and `_apply_jinja_template` up to the template call (which `chat_template.py` makes). Both read
and mutate the pydantic request the way SGLang does (tool schemas are normalised in place on 0.5.22+).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson

from .dialect import Dialect
from .tool_schema import normalize_types, schema_error

_MEDIA_PART_TYPES = ("image_url", "video_url", "audio_url")


@dataclass
class ChatPrompt:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reasoning_effort: Any
    template_kwargs: dict[str, Any]  # chat_template_kwargs without the popped reasoning_effort
    assistant_prefix: str | None  # continue_final_message: tokenized separately and appended
    input_ids: list[int] | None = None  # 0.5.22+: the request's own prompt, the template is skipped

    @cached_property
    def cache_key(self) -> bytes:
        """Everything that reaches the template, in order (templates render dicts in their key order)."""
        return orjson.dumps([self.messages, self.tools, self.reasoning_effort, self.template_kwargs,
                             self.assistant_prefix])


def _effective_tools(req: Any, d: Dialect) -> list[Any]:
    """0.5.22+ also counts tools carried by system/developer (0.5.23: root) messages (`_effective_tools`)."""
    tools = list(req.tools or [])
    if d >= Dialect.V0_5_22:
        hosts = ("root", "system", "developer") if d >= Dialect.V0_5_23 else ("system", "developer")
        for m in req.messages:
            if m.role in hosts and getattr(m, "tools", None):
                tools.extend(m.tools)
    return tools


def check_request(req: Any, d: Dialect, context_length: int) -> str | None:
    """sglang serving_chat.py: OpenAIServingChat._validate_request (the checks that apply to this server)."""
    if not req.messages:
        return "Messages cannot be empty."
    if d >= Dialect.V0_5_22:
        if req.chat_template_kwargs and "chat_template" in req.chat_template_kwargs:
            return ("Request-supplied chat_template is not allowed. Start the server with "
                    "--trust-request-chat-template to permit it.")
        media = next((p.type for m in req.messages if isinstance(m.content, list) for p in m.content
                      if p.type in _MEDIA_PART_TYPES), None)
        if media is not None:  # _validate_media_content: this model is text-only
            return f"Model only supports text input; received unsupported content type '{media}'."
    tools = _effective_tools(req, d)
    if req.tool_choice == "required" and not tools:
        return "Tools cannot be empty if tool choice is set to required."
    if not isinstance(req.tool_choice, str):
        if not tools:
            return "Tools cannot be empty if tool choice is set to a specific tool."
        name = req.tool_choice.function.name
        if not any(t.function.name == name for t in tools):
            return f"Tool '{name}' not found in tools list."
    if d >= Dialect.V0_5_22 and len(tools) > len(req.tools or []):
        names = [t.function.name for t in tools]
        if len(names) != len(set(names)):
            return "Tool names must be unique across request and message tools."
    for i, tool in enumerate(tools):
        if tool.function.parameters is None:
            continue
        try:
            if d >= Dialect.V0_5_22:
                normalize_types(tool.function.parameters)
            err = schema_error(tool.function.parameters)
        except RecursionError:
            if d < Dialect.V0_5_22:
                raise  # uncaught in 0.5.8: a 500
            return f"Tool {i} function 'parameters' schema is too deeply nested or contains a cycle."
        if err is not None:
            return f"Tool {i} function has invalid 'parameters' schema: {err}"
    max_output = req.max_completion_tokens or req.max_tokens
    if max_output and max_output > context_length:
        return (f"max_completion_tokens is too large: {max_output}.This model supports at most {context_length} "
                "completion tokens.")
    return None


def _template_tools(req: Any, d: Dialect) -> list[dict[str, Any]] | None:
    """Tools reach the template only when non-empty and tool_choice != "none"; a named choice keeps that one.
    0.5.8 renders the bare Function dump, 0.5.22+ the whole Tool dump (`_process_messages`)."""
    if req.tool_choice == "none":
        return None
    named = None if isinstance(req.tool_choice, str) else req.tool_choice.function.name
    if d >= Dialect.V0_5_22:
        if not _effective_tools(req, d):
            return None
        if named is not None:
            return [t.model_dump() for t in req.tools or [] if t.function.name == named] or None
        return [t.model_dump() for t in req.tools] if req.tools else None
    if not req.tools:
        return None
    return [t.function.model_dump() for t in req.tools if named is None or t.function.name == named]


def _template_message(msg: dict[str, Any], content_format: str, d: Dialect) -> dict[str, Any]:
    """sglang jinja_template_utils.py: process_content_for_template_format (media data is ignored: text-only)."""
    content = msg.get("content")
    if not isinstance(content, list):
        return {k: v for k, v in msg.items() if v is not None}
    new = d >= Dialect.V0_5_22
    text_types = ("text", "input_text") if new else ("text",)
    if content_format == "string":
        texts = [p["text"] for p in content if isinstance(p, dict) and p.get("type") in text_types]
        flat = {**msg, "content": " ".join(texts)}
        return {k: v for k, v in flat.items() if v is not None}
    parts = []
    for p in content:
        kind = p.get("type")
        if kind in ("image_url", "input_image"):
            parts.append({"type": "image"})
        elif kind == "video_url":
            parts.append({"type": "video"})
        elif kind == "audio_url":
            parts.append({"type": "audio"})
        elif not new:
            parts.append(p)
        elif kind in text_types:
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "tool_reference":
            parts.append(p)  # thinking/reasoning parts are dropped
    out = {k: v for k, v in msg.items() if v is not None and k != "content"}
    out["content"] = parts
    return out


def _join_tool_text(msg: dict[str, Any]) -> None:
    """0.5.22+ serving_chat.py: normalize_tool_content (a tool message of text parts becomes one string)."""
    content = msg.get("content")
    if msg["role"] == "tool" and isinstance(content, list) and all(
            (isinstance(p, dict) and p.get("type") == "text") or isinstance(p, str) for p in content):
        msg["content"] = " ".join(p.get("text", "") if isinstance(p, dict) else p for p in content)


def _parse_arguments(msg: dict[str, Any], d: Dialect) -> None:
    """Assistant tool-call `arguments` strings become objects: 0.5.8 any JSON (in `_apply_jinja_template`),
    0.5.22+ a JSON object only (`normalize_assistant_tool_call_arguments`). Raises ValueError (400)."""
    if msg.get("role") != "assistant" or not isinstance(msg.get("tool_calls"), list):
        return
    for call in msg["tool_calls"]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
            continue
        if d < Dialect.V0_5_22:
            fn["arguments"] = orjson.loads(fn["arguments"])
            continue
        try:
            parsed = orjson.loads(fn["arguments"])
        except orjson.JSONDecodeError as e:
            raise ValueError("Assistant tool call function.arguments must be valid JSON.") from e
        if not isinstance(parsed, dict):
            raise ValueError("Assistant tool call function.arguments must be a JSON object.")
        fn["arguments"] = parsed


def _split_last_assistant(messages: list[dict[str, Any]], continue_final: bool
                          ) -> tuple[list[dict[str, Any]], str | None]:
    """sglang serving_chat.py: OpenAIServingChat._handle_last_assistant_message. A trailing assistant turn with string
    content becomes a user turn, or with continue_final_message is cut off and later appended as separate ids."""
    if messages and messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content"), str):
        text = messages[-1]["content"]
        if continue_final:
            return messages[:-1], text
        messages[-1] = {"role": "user", "content": text}
    return messages, None


def build_prompt(req: Any, d: Dialect, content_format: str,
                 default_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """Messages, tools and template kwargs as SGLang passes them to apply_chat_template. Raises ValueError (400)."""
    if default_kwargs:  # 0.5.22+ serving_chat.py: _process_messages, under what the request set
        req.chat_template_kwargs = {**default_kwargs, **(req.chat_template_kwargs or {})}
        effort = req.chat_template_kwargs.get("reasoning_effort")
        if effort is not None and req.reasoning_effort is None:
            req.reasoning_effort = effort
    ctk = req.chat_template_kwargs
    effort = ctk.pop("reasoning_effort", None) if ctk else None  # _convert_to_internal_request, unvalidated
    if effort is not None:
        req.reasoning_effort = effort
    tools = _template_tools(req, d)
    if d >= Dialect.V0_5_22 and req.input_ids is not None:
        return ChatPrompt([], tools, req.reasoning_effort, ctk or {}, None, input_ids=req.input_ids)
    messages = []
    for msg in req.messages:  # the order of these steps differs between releases without changing the outcome
        m = msg.model_dump()
        if m["content"] is None:
            m["content"] = ""
        m = _template_message(m, content_format, d)
        _parse_arguments(m, d)
        if d >= Dialect.V0_5_22:
            _join_tool_text(m)
        messages.append(m)
    messages, prefix = _split_last_assistant(messages, req.continue_final_message)
    return ChatPrompt(messages, tools, req.reasoning_effort, ctk or {}, prefix)
