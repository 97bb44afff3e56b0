"""A chat request reduced to what SGLang's request models keep, forwarded in that form and rendered per dialect.

SGLang never renders the client's raw JSON: it parses it into pydantic models (unknown fields dropped at every
level, roles lower-cased, booleans coerced), dumps them back to dicts, reshapes content, tool calls and tools per
version, and only then calls the chat template. kvgate does the same reduction itself and forwards the *reduced*
request, so the engine re-parses exactly what kvgate rendered and counted; whatever kvgate cannot reduce exactly is
refused with 400. Every step names the SGLang function it follows (`sglang vX python/sglang/srt/...`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from gateway.admission.dialects import Dialect
from gateway.errors import bad_request
from gateway.template_kwargs import APPLY_CHAT_TEMPLATE_PARAMETERS, SGLANG_HANDLED_KWARGS

_GENERIC_ROLES = frozenset({"system", "assistant", "tool", "function", "developer"})
# Values valid for `reasoning_effort` in every dialect (0.5.8 accepts only these three).
_REASONING_EFFORTS = frozenset({"low", "medium", "high"})
_TOOL_CHOICES = frozenset({"none", "auto", "required"})
# Pydantic's lax booleans (strings compared case-insensitively).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
MAX_MESSAGES = 65_536
MAX_TOOLS = 8_192
_JSON_SCHEMA_TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
MAX_JSON_DEPTH = 32
MAX_JSON_NODES = 65_536  # objects, arrays and values in one free-form field (tool schemas, kwargs, formats)
MAX_FIELD_CHARS = 1 << 20  # characters of text in one field that is not the prompt itself


def with_engine_defaults(settings: ChatSettings, defaults_json: str | None) -> ChatSettings:
    """`settings` with the engines' --default-chat-template-kwargs (JSON, as the identity holds them) applied. A
    value that is not an object fails the deployment check; under `warn` nothing is applied."""
    if defaults_json == settings.engine_defaults_json:
        return settings
    defaults = orjson.loads(defaults_json) if defaults_json else {}
    return replace(settings, engine_defaults=defaults if isinstance(defaults, dict) else {},
                   engine_defaults_json=defaults_json)


def default_template_kwargs(variables_read: frozenset[str]) -> frozenset[str]:
    """What a client may send in chat_template_kwargs by default: the variables the template reads, minus the
    names that are parameters of the call or that SGLang handles itself."""
    return variables_read - APPLY_CHAT_TEMPLATE_PARAMETERS - SGLANG_HANDLED_KWARGS


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """Per model: how its template wants content, and which `chat_template_kwargs` a client may send."""

    content_format: str                 # "openai" | "string" (jinja_template_utils.py: detect_..._content_format)
    template_kwargs: frozenset[str]
    # The engines' --default-chat-template-kwargs (0.5.22+), as the KV-pool gate read them: applied by kvgate.
    engine_defaults: Mapping[str, Any] = field(default_factory=dict)
    engine_defaults_json: str | None = None  # the same, as the engines' identities state them


@dataclass(frozen=True, slots=True)
class RenderPlan:
    """Everything one dialect's engine hands to the chat template for this request."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    fallback_tools: list[dict[str, Any]] | None  # what SGLang retries with when the first render raises
    documents: Any
    variables: dict[str, Any]
    assistant_prefix: str | None  # tokenized on its own and appended (continue_final_message)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """The reduced chat: forwarded verbatim (see `forwarded`), rendered with `plan`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    template_kwargs: dict[str, Any]
    reasoning_effort: str | None
    continue_final_message: bool
    # The engines' default template kwargs merged into template_kwargs (JSON; None: none): dispatch checks that the
    # engines about to render it still have these.
    engine_defaults_json: str | None = None

    def forwarded(self) -> dict[str, Any]:
        """The prompt-shaping fields of the engine body, in the reduced form."""
        body: dict[str, Any] = {"messages": self.messages}
        if self.tools and self.tool_choice != "none":  # with "none" SGLang neither renders nor parses them
            body["tools"] = self.tools
            body["tool_choice"] = self.tool_choice
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        if self.reasoning_effort is not None:
            body["reasoning_effort"] = self.reasoning_effort
        if self.continue_final_message:
            body["continue_final_message"] = True
        return body

    def plan(self, dialect: Dialect, content_format: str) -> RenderPlan:
        tools, fallback = self._template_tools(dialect)
        messages = [_template_message(m, dialect, content_format) for m in self.messages]
        messages, prefix = _handle_last_assistant(messages, self.continue_final_message)
        kwargs = dict(self.template_kwargs)
        documents = kwargs.pop("documents", None)
        return RenderPlan(messages, tools, fallback, documents, self._variables(dialect, kwargs), prefix)

    def _template_tools(self, dialect: Dialect) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
        """serving_chat.py: OpenAIServingChat._process_messages (tools reach the template only if non-empty and
        tool_choice is not "none"; a named choice keeps that tool) and _apply_jinja_template's retry shape."""
        if not self.tools or self.tool_choice == "none":
            return None, None
        chosen = self.tools
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            chosen = [t for t in self.tools if t["function"]["name"] == name]
        if dialect is Dialect.V0_5_8:
            # [0.5.8] item.function.model_dump(): the bare function; the retry wraps it in {"function": ...}.
            dumped = [_function_dump_fixed(t["function"]) for t in chosen]
            return dumped, [{"function": t} for t in dumped]
        # [0.5.22+] item.model_dump(): the Tool wrapper with its own null defer_loading; the retry unwraps it.
        dump = _function_dump_fixed if dialect is Dialect.V0_5_22 else _function_dump_client_order
        dumped = [{"type": t["type"], "function": dump(t["function"]), "defer_loading": None} for t in chosen]
        return dumped, [t["function"] for t in dumped]

    def _variables(self, dialect: Dialect, kwargs: dict[str, Any]) -> dict[str, Any]:
        effort = self.reasoning_effort
        if dialect is Dialect.V0_5_8:
            # 0.5.8 always passes reasoning_effort, defaulting to "medium" (protocol.py: ChatCompletionRequest).
            return {"reasoning_effort": effort or "medium", **kwargs}
        variables: dict[str, Any] = {}
        if effort is not None:
            # protocol.py: ChatCompletionRequest.normalize_reasoning_inputs sets both flags when effort is set.
            kwargs.setdefault("thinking", effort != "none")
            kwargs.setdefault("enable_thinking", effort != "none")
            variables["reasoning_effort"] = effort
        variables.update(kwargs)
        return variables


def parse_chat(body: dict[str, Any], settings: ChatSettings) -> ChatPrompt:
    """Validate and reduce the prompt-shaping fields of a chat body; 400 for anything kvgate cannot count."""
    for name, why in (("input_ids", "send token ids to /v1/completions or /generate"),
                      ("reasoning", "use reasoning_effort or chat_template_kwargs")):
        if body.get(name) is not None:
            raise bad_request(f"{name} is not supported on chat completions by this gateway; {why}", param=name)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("messages must be a non-empty array of message objects", param="messages")
    if len(raw_messages) > MAX_MESSAGES:
        raise bad_request(f"at most {MAX_MESSAGES} messages are accepted", param="messages")
    messages = [_message(i, m) for i, m in enumerate(raw_messages)]
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), body.get("tools") is None, tools)
    effort = _reasoning_effort(body.get("reasoning_effort"))
    kwargs = _template_kwargs(body.get("chat_template_kwargs"), settings.template_kwargs)
    return ChatPrompt(messages=messages, tools=tools, tool_choice=tool_choice,
                      template_kwargs=_with_engine_defaults(kwargs, settings.engine_defaults, effort),
                      reasoning_effort=effort,
                      continue_final_message=_lax_bool(body.get("continue_final_message", False),
                                                       "continue_final_message"),
                      engine_defaults_json=settings.engine_defaults_json)


# ── request models (protocol.py: ChatCompletionMessageUserParam / GenericParam, ToolCall, Tool, Function) ──────
def _message(index: int, raw: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise bad_request(f"{where} must be an object with a string role", param="messages")
    role = raw["role"]
    content = raw.get("content")
    if role == "user":
        # The user model keeps role and content only: a user `name` is dropped, content may not be null.
        if content is None:
            raise bad_request(f"{where}.content is required for a user message", param="messages")
        return {"role": "user", "content": _content(where, content)}
    lowered = role.lower()
    if lowered not in _GENERIC_ROLES:
        raise bad_request(f"{where}.role must be user, or one of system, developer, assistant, tool, function "
                          f"(case-insensitive), got {role!r}", param="messages")
    if raw.get("tools") is not None:
        raise bad_request(f"{where}.tools (tools on a message) is not supported; send tools at the top level",
                          param="messages")
    message: dict[str, Any] = {"role": lowered, "content": "" if content is None else _content(where, content)}
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = raw.get(key)
        if value is not None:
            message[key] = _text(value, f"{where}.{key}")
    calls = raw.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be an array", param="messages")
        message["tool_calls"] = [_tool_call(f"{where}.tool_calls[{i}]", c) for i, c in enumerate(calls)]
    return message


def _content(where: str, content: Any) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content parts", param="messages")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content[{i}]: only text parts are accepted for this text-only model "
                              f"(got {kind!r})", param="messages")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{i}].text must be a string", param="messages")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _tool_call(where: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise bad_request(f"{where} must be an object with a function object", param="messages")
    if raw.get("type", "function") != "function":
        raise bad_request(f"{where}.type must be 'function'", param="messages")
    call: dict[str, Any] = {"type": "function"}
    if raw.get("id") is not None:
        call["id"] = _text(raw["id"], f"{where}.id")
    if raw.get("index") is not None:
        call["index"] = _integer(raw["index"], f"{where}.index")
    function = raw["function"]
    reduced: dict[str, Any] = {}
    if function.get("name") is not None:
        reduced["name"] = _text(function["name"], f"{where}.function.name")
    arguments = function.get("arguments")
    if arguments is not None:
        if not isinstance(arguments, (str, dict)):
            raise bad_request(f"{where}.function.arguments must be a JSON string or an object", param="messages")
        _check_depth(arguments, f"{where}.function.arguments")
        reduced["arguments"] = arguments
    call["function"] = reduced
    return call


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("tools must be an array", param="tools")
    if len(raw) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools are accepted", param="tools")
    return [_tool(i, tool) for i, tool in enumerate(raw)]


def _tool(index: int, raw: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise bad_request(f"{where} must be an object with a function object", param="tools")
    kind = raw.get("type", "function")
    if not isinstance(kind, str):
        raise bad_request(f"{where}.type must be a string", param="tools")
    function: dict[str, Any] = {}
    # The client's key order is kept: 0.5.23 renders the function with it.
    for key, value in raw["function"].items():
        if value is None:
            continue
        if key == "name" or key == "description":
            function[key] = _typed(value, str, f"{where}.function.{key}")
        elif key == "parameters":
            _check_depth(value, f"{where}.function.parameters")
            _check_schema_types(value, f"{where}.function.parameters")
            function[key] = value
        elif key == "strict":
            function[key] = _lax_bool(value, f"{where}.function.strict")
    if "name" not in function:
        raise bad_request(f"{where}.function.name is required", param="tools")
    return {"type": kind, "function": function}


def _tool_choice(raw: Any, tools_absent: bool, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    """protocol.py: set_tool_choice_default; serving_chat.py: _validate_request."""
    if raw is None:
        return "none" if tools_absent else "auto"
    if isinstance(raw, str):
        if raw not in _TOOL_CHOICES:
            raise bad_request("tool_choice must be none, auto, required or a function choice", param="tool_choice")
        if raw == "required" and not tools:
            raise bad_request("tool_choice required needs tools", param="tool_choice")
        return raw
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or raw.get("type", "function") != "function":
        raise bad_request("tool_choice must name a function: {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          param="tool_choice")
    name = function["name"]
    if not any(t["function"]["name"] == name for t in tools):
        raise bad_request(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return {"type": "function", "function": {"name": name}}


def _template_kwargs(raw: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad_request("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for key, value in raw.items():
        if key not in allowed:
            names = ", ".join(sorted(allowed)) or "none"
            raise bad_request(f"chat_template_kwargs.{key} is not accepted for this model (accepted: {names})",
                              param="chat_template_kwargs")
        _check_depth(value, f"chat_template_kwargs.{key}")
    return dict(raw)


def _with_engine_defaults(kwargs: dict[str, Any], defaults: Mapping[str, Any], effort: str | None) -> dict[str, Any]:
    """SGLang 0.5.22+ fills what a request's chat_template_kwargs leave unset with the engine's
    --default-chat-template-kwargs (serving_chat.py: OpenAIServingChat._process_messages), after the request model
    set thinking/enable_thinking from reasoning_effort (protocol.py: normalize_reasoning_inputs). kvgate does the
    same and forwards the result: every engine then renders exactly what was counted (the defaults fill nothing
    more), 0.5.8 ones included, which have no defaults of their own."""
    if not defaults:
        return kwargs
    merged = dict(kwargs)
    if effort is not None:
        merged.setdefault("thinking", effort != "none")
        merged.setdefault("enable_thinking", effort != "none")
    for key, value in defaults.items():
        merged.setdefault(key, value)
    return merged


def _reasoning_effort(raw: Any) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or raw not in _REASONING_EFFORTS:
        raise bad_request("reasoning_effort must be low, medium or high", param="reasoning_effort")
    return raw


# ── what the template sees (serving_chat.py: OpenAIServingChat._apply_jinja_template) ─────────────────────────
def _template_message(message: dict[str, Any], dialect: Dialect, content_format: str) -> dict[str, Any]:
    """model_dump() with its None fields gone (jinja_template_utils.py: process_content_for_template_format),
    content reshaped for the template's format, assistant tool-call arguments parsed, and [0.5.22+] a tool
    message's text parts joined (serving_chat.py: normalize_tool_content)."""
    dumped = dict(message)
    if "tool_calls" in dumped:
        dumped["tool_calls"] = [_tool_call_dump(call, dialect, dumped["role"]) for call in dumped["tool_calls"]]
    content = dumped["content"]
    if isinstance(content, list):
        if content_format == "openai":
            del dumped["content"]  # rebuilt last, as process_content_for_template_format does
            dumped["content"] = [dict(part) for part in content]
        else:
            dumped["content"] = " ".join(part["text"] for part in content)
        if dialect is not Dialect.V0_5_8 and dumped["role"] == "tool" and isinstance(dumped["content"], list):
            dumped["content"] = " ".join(part["text"] for part in dumped["content"])
    return dumped


def _tool_call_dump(call: dict[str, Any], dialect: Dialect, role: str) -> dict[str, Any]:
    function = call["function"]
    arguments = function.get("arguments")
    if role == "assistant" and isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"tool call arguments are not valid JSON: {exc}", param="messages") from exc
        if dialect is not Dialect.V0_5_8 and not isinstance(arguments, dict):
            # serving_chat.py [0.5.22+]: parse_tool_call_arguments requires a JSON object.
            raise bad_request("tool call arguments must be a JSON object", param="messages")
    # Nested None values stay: only top-level None keys are dropped.
    return {"id": call.get("id"), "index": call.get("index"), "type": "function",
            "function": {"name": function.get("name"), "arguments": arguments}}


def _handle_last_assistant(messages: list[dict[str, Any]], continue_final: bool
                           ) -> tuple[list[dict[str, Any]], str | None]:
    """serving_chat.py: OpenAIServingChat._handle_last_assistant_message — a trailing assistant message with text
    content becomes a user turn, or with continue_final_message is cut off and tokenized on its own."""
    if not messages or messages[-1]["role"] != "assistant" or not isinstance(messages[-1]["content"], str):
        return messages, None
    text = messages[-1]["content"]
    if continue_final:
        return messages[:-1], text
    return [*messages[:-1], {"role": "user", "content": text}], None


def _function_dump_fixed(function: dict[str, Any]) -> dict[str, Any]:
    """Function.model_dump() in 0.5.8 and 0.5.22: every field in declaration order, `strict` defaulting to False
    (0.5.22's serializer only drops its own null `defer_loading`, which kvgate never forwards)."""
    return {"description": function.get("description"), "name": function["name"],
            "parameters": function.get("parameters"), "strict": function.get("strict", False)}


def _function_dump_client_order(function: dict[str, Any]) -> dict[str, Any]:
    """0.5.23's Function serializer: the client's key order, `strict` only when sent, a missing description or
    parameters appended as null."""
    dumped = {key: function[key] for key in function}
    for key in ("description", "parameters"):
        dumped.setdefault(key, None)
    return dumped


# ── value checks ────────────────────────────────────────────────────────────────────────────────────────────
def _lax_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise bad_request(f"{name} must be a boolean", param=name.split(".")[0].split("[")[0])


def _text(value: Any, name: str) -> str:
    """A string field beside the content: templates may not render it, so its size is capped, not counted."""
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string", param=name.split(".")[0].split("[")[0])
    if len(value) > MAX_FIELD_CHARS:
        raise bad_request(f"{name} holds more than {MAX_FIELD_CHARS} characters",
                          param=name.split(".")[0].split("[")[0])
    return value


def _typed(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        raise bad_request(f"{name} must be a {kind.__name__}", param=name.split(".")[0].split("[")[0])
    return value


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", param=name.split(".")[0].split("[")[0])
    return value


def _check_schema_types(schema: Any, name: str) -> None:
    """SGLang 0.5.22+ rewrites non-standard `"type"` names in tool schemas ("varchar", "int", duplicates in a type
    list) before rendering them (function_call/utils.py: normalize_json_schema_types); 0.5.8 renders them as sent.
    Only schemas the rewrite leaves untouched render alike in every version: others are refused."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            kind = node.get("type")
            types = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
            if any(not isinstance(t, str) or t not in _JSON_SCHEMA_TYPES for t in types) \
                    or len(set(map(str, types))) != len(types):
                raise bad_request(f"{name}: type {kind!r} is not a standard JSON Schema type (or repeats one)",
                                  param="tools")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_depth(value: Any, name: str) -> None:
    """Free-form JSON the gateway forwards must stay small and shallow enough to render and re-serialise."""
    problem = free_form_problem(value)
    if problem:
        raise bad_request(f"{name} {problem}", param=name.split(".")[0].split("[")[0])


def free_form_problem(value: Any) -> str | None:
    """Why JSON `value` is too deep or too large to forward, or None (iterative: no recursion limit to hit)."""
    stack = [(value, 1)]
    nodes = chars = 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if depth > MAX_JSON_DEPTH:
            return f"is nested deeper than {MAX_JSON_DEPTH} levels"
        if nodes > MAX_JSON_NODES:
            return f"holds more than {MAX_JSON_NODES} JSON values"
        if isinstance(item, dict):
            chars += sum(len(key) for key in item)
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            chars += len(item)
        if chars > MAX_FIELD_CHARS:
            return f"holds more than {MAX_FIELD_CHARS} characters"
    return None
