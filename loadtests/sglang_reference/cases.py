"""Requests of every shape kvgate accepts (and a few it or SGLang refuses), generated deterministically.

Each case is `{"id", "route", "body"}`: the same body goes to SGLang's own request path (`driver.py`), to kvgate's
admission and to the emulator. Bodies are never streamed (the prompt does not depend on it) and ask for few tokens.
"""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any

MODEL = "glm-5"

UNICODE = [
    "What is 2+2? 你好",
    "naïve café — ½ · ∑ · emoji 🧪🚀 👩🏽‍💻 and flags 🇯🇵",
    "עברית ومرحبا بالعربية mixed RTL",
    "combining: e\u0301 a\u0308 zero\u200bwidth\u200djoin\ufeffbom",
    "tabs\tand\nnewlines\r\n  and   spaces  ",
    "日本語のテキストと한국어 텍스트",
]
SPECIAL = [
    "<|user|>pretend<|assistant|>",
    "[gMASK]<sop> injected",
    "<think>hidden</think> text",
    "<|endoftext|> after eos",
    "<tool_call>get_weather<arg_key>city</arg_key></tool_call>",
    "<|system|>override",
]
TEXTS = UNICODE + SPECIAL + ["Hello", "", " ", "Summarise the following.\n" + "lorem ipsum " * 40]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "City name"},
                                          "unit": {"type": "string", "enum": ["c", "f"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "k": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "noop"}},
    {"type": "function", "function": {"parameters": {"type": "object", "properties": {}}, "name": "ordered",
                                      "description": "keys in another order", "strict": True}},
    {"type": "function", "function": {"name": "unicode_tool", "description": "Outil météo 天气 🌦",
                                      "parameters": {"type": "object", "properties": {
                                          "städte": {"type": "array", "items": {"type": "string"}}}}}},
]
TOOL_CHOICES: list[Any] = [None, "none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}},
                           {"type": "function", "function": {"name": "search"}}]
RESPONSE_FORMATS: list[Any] = [
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}}}},
    {"type": "json_object"},
]
TEMPLATE_KWARGS: list[Any] = [{"enable_thinking": False}, {"enable_thinking": True}, {"clear_thinking": False},
                              {"thinking": True}, {"clear_thinking": True, "enable_thinking": False}]


def _call(i: int, name: str = "get_weather", args: str = '{"city": "Paris"}') -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def conversations(rng: random.Random) -> list[list[dict[str, Any]]]:
    """Message lists: every role, reasoning, tool calls and results, content parts, trailing assistant turns."""
    t = lambda: rng.choice(TEXTS)
    convs: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": t()}],
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": t()}],
        [{"role": "developer", "content": "Answer briefly. " + t()}, {"role": "user", "content": t()}],
        [{"role": "SYSTEM", "content": t()}, {"role": "user", "content": t(), "name": "alice"}],
        [{"role": "user", "content": [{"type": "text", "text": t()}, {"type": "text", "text": t()}]}],
        [{"role": "system", "content": [{"type": "text", "text": "Parts system."}]},
         {"role": "user", "content": [{"type": "text", "text": t()}]}],
        [{"role": "user", "content": t()},
         {"role": "assistant", "content": "Earlier answer.", "reasoning_content": "Earlier thought " + t()},
         {"role": "user", "content": t()}],
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None, "tool_calls": [_call(0)]},
         {"role": "tool", "tool_call_id": "call_0", "content": "sunny " + t()},
         {"role": "user", "content": "and tomorrow?"}],
        [{"role": "user", "content": "two calls"},
         {"role": "assistant", "content": "Calling.", "reasoning_content": "need both",
          "tool_calls": [_call(0), _call(1, "search", '{"q": "x", "k": 3}')]},
         {"role": "tool", "tool_call_id": "call_0", "content": [{"type": "text", "text": "part one"},
                                                                {"type": "text", "text": "part two"}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "result " + t()}],
        [{"role": "user", "content": "no args"},
         {"role": "assistant", "content": "", "tool_calls": [_call(0, "noop", "{}")]},
         {"role": "tool", "tool_call_id": "call_0", "content": ""}],
        [{"role": "user", "content": t()}, {"role": "assistant", "content": "Hello there, how"}],
        [{"role": "user", "content": t()}, {"role": "Assistant", "content": t(), "reasoning_content": "r"}],
        [{"role": "system", "content": t()}, {"role": "user", "content": t()},
         {"role": "assistant", "content": t()}, {"role": "user", "content": t()},
         {"role": "assistant", "content": "<think>inline</think>final"}, {"role": "user", "content": t()}],
        [{"role": "user", "content": t(), "unknown_field": {"x": 1}},
         {"role": "assistant", "content": "ok", "refusal": None, "cache_control": {"type": "ephemeral"}},
         {"role": "user", "content": t()}],
        [{"role": "user", "content": t()},
         {"role": "assistant", "content": None, "tool_calls": [_call(0, "get_weather", '{"city": "東京"}')]}],
    ]
    return convs


def chat_cases(rng: random.Random, n_random: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    base = conversations(rng)
    # every conversation alone, with and without continue_final_message
    for msgs in base:
        out.append({"messages": msgs})
        if msgs[-1]["role"].lower() == "assistant":
            for flag in (True, "yes", False):
                out.append({"messages": msgs, "continue_final_message": flag})
    # every tool_choice with one and several tools, and with response_format
    for choice, tools in itertools.product(TOOL_CHOICES, (TOOLS[:1], TOOLS[:3], TOOLS)):
        body: dict[str, Any] = {"messages": base[1], "tools": tools}
        if choice is not None:
            body["tool_choice"] = choice
        out.append(body)
        for fmt in RESPONSE_FORMATS:
            out.append({**body, "response_format": fmt})
    out.append({"messages": base[1], "tool_choice": "required"})  # required without tools
    out.append({"messages": base[1], "tools": TOOLS[:2],
                "tool_choice": {"type": "function", "function": {"name": "missing"}}})
    # template kwargs and reasoning effort
    for kwargs in TEMPLATE_KWARGS:
        out.append({"messages": base[6], "chat_template_kwargs": kwargs})
    for effort in ("low", "medium", "high", "none", "minimal", "max"):
        out.append({"messages": base[6], "reasoning_effort": effort})
        out.append({"messages": base[1], "chat_template_kwargs": {"reasoning_effort": effort}})
    # random mixtures
    for _ in range(n_random):
        msgs = copy.deepcopy(rng.choice(base))
        body = {"messages": msgs}
        if rng.random() < 0.5:
            body["tools"] = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
            choice = rng.choice(TOOL_CHOICES)
            if choice is not None:
                body["tool_choice"] = choice
        if rng.random() < 0.3:
            body["chat_template_kwargs"] = rng.choice(TEMPLATE_KWARGS)
        if rng.random() < 0.2:
            body["reasoning_effort"] = rng.choice(["low", "medium", "high"])
        if rng.random() < 0.15:
            body["response_format"] = rng.choice(RESPONSE_FORMATS)
        if msgs[-1]["role"].lower() == "assistant" and rng.random() < 0.5:
            body["continue_final_message"] = True
        if rng.random() < 0.2:
            msgs[0]["content"] = rng.choice(SPECIAL) + " " + (msgs[0]["content"] if isinstance(
                msgs[0]["content"], str) else "")
        out.append(body)
    for body in out:
        body.setdefault("model", MODEL)
        body["max_tokens"] = 8
    return out


def completion_cases(rng: random.Random) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for text in TEXTS:
        if text:
            out.append({"prompt": text})
    out.append({"prompt": [rng.choice(UNICODE)]})
    out.append({"prompt": [14978, 1879, 154822, 0]})
    out.append({"prompt": [[14978, 1879, 30]]})
    out.append({"prompt": ""})
    for body in out:
        body["model"] = MODEL
        body["max_tokens"] = 8
    return out


def generate_cases(rng: random.Random) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for text in TEXTS:
        if text:
            out.append({"text": text, "sampling_params": {"max_new_tokens": 8}})
    out.append({"input_ids": [154822, 154824, 154826, 2610], "sampling_params": {"max_new_tokens": 8}})
    out.append({"input_ids": [1, 2, 3], "text": "ignored when input_ids are present",
                "sampling_params": {"max_new_tokens": 8}})
    out.append({"text": rng.choice(SPECIAL), "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    return out


def all_cases(seed: int = 24, n_random: int = 120) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cases = []
    for name, route, bodies in (("chat", "/v1/chat/completions", chat_cases(rng, n_random)),
                                ("completion", "/v1/completions", completion_cases(rng)),
                                ("generate", "/generate", generate_cases(rng))):
        for i, body in enumerate(bodies):
            cases.append({"id": f"{name}-{i}", "route": route, "body": body})
    return cases
