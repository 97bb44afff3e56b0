"""Decode's event stream → the non-streaming response body a client asked for.

The gateway always streams from decode (to know when the first token came); a non-streaming client gets the same
body SGLang would have sent it.
"""

from __future__ import annotations

from typing import Any

import orjson


def assemble(route: str, events: list[bytes]) -> bytes:
    if route == "/generate":
        # SGLang's /generate stream is cumulative: its last event is the whole response.
        return events[-1]
    chunks = [orjson.loads(event) for event in events]
    if route == "/v1/chat/completions":
        return orjson.dumps(_chat(chunks))
    return orjson.dumps(_completion(chunks))


def _base(chunks: list[dict[str, Any]], obj: str) -> dict[str, Any]:
    first = chunks[0]
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    return {"id": first.get("id"), "object": obj, "created": first.get("created"), "model": first.get("model"),
            "choices": [], "usage": usage}


def _chat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    result = _base(chunks, "chat.completion")
    content: list[str] = []
    reasoning: list[str] = []
    tool_calls: dict[int, dict[str, Any]] = {}
    logprobs: list[Any] = []
    finish_reason = matched_stop = None
    role = "assistant"
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            role = delta.get("role") or role
            if delta.get("content"):
                content.append(delta["content"])
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or ():
                _merge_tool_call(tool_calls, call)
            if choice.get("logprobs") and choice["logprobs"].get("content"):
                logprobs.extend(choice["logprobs"]["content"])
            finish_reason = choice.get("finish_reason") or finish_reason
            matched_stop = choice.get("matched_stop", matched_stop)
    message: dict[str, Any] = {"role": role, "content": "".join(content) if content or not tool_calls else None,
                               "reasoning_content": "".join(reasoning) or None,
                               "tool_calls": [tool_calls[i] for i in sorted(tool_calls)] or None}
    result["choices"].append({"index": 0, "message": message,
                              "logprobs": {"content": logprobs} if logprobs else None,
                              "finish_reason": finish_reason, "matched_stop": matched_stop})
    return result


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    index = delta.get("index", len(calls))
    call = calls.setdefault(index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call["id"] = delta.get("id") or call["id"]
    function = delta.get("function") or {}
    call["function"]["name"] += function.get("name") or ""
    call["function"]["arguments"] += function.get("arguments") or ""


def _completion(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    result = _base(chunks, "text_completion")
    text: list[str] = []
    finish_reason = matched_stop = None
    logprobs: dict[str, list[Any]] | None = None
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            text.append(choice.get("text") or "")
            finish_reason = choice.get("finish_reason") or finish_reason
            matched_stop = choice.get("matched_stop", matched_stop)
            part = choice.get("logprobs")
            if part:
                logprobs = logprobs or {key: [] for key in part}
                for key, values in part.items():
                    if isinstance(values, list):
                        logprobs.setdefault(key, []).extend(values)
    result["choices"].append({"index": 0, "text": "".join(text), "logprobs": logprobs,
                              "finish_reason": finish_reason, "matched_stop": matched_stop})
    return result
