"""Decode's event stream → the non-streaming response body a client asked for, built as the events arrive.

The gateway always streams from decode (to know when the first token came); a non-streaming client gets the same
body SGLang would have sent it. Memory stays proportional to the output: /generate events are cumulative, so only
the last one is kept; OpenAI chunks are folded into the response as they come.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson


class Assembler(Protocol):
    def add(self, payload: bytes) -> None: ...
    def body(self) -> bytes: ...


def assembler_for(route: str) -> Assembler:
    if route == "/generate":
        return GenerateAssembler()
    if route == "/v1/chat/completions":
        return ChatAssembler()
    return CompletionAssembler()


class GenerateAssembler:
    """SGLang's /generate stream is cumulative: its last event is the whole response."""

    def __init__(self) -> None:
        self._last = b"{}"

    def add(self, payload: bytes) -> None:
        self._last = payload

    def body(self) -> bytes:
        return self._last


class _OpenAIAssembler:
    object_name = ""

    def __init__(self) -> None:
        self._head: dict[str, Any] | None = None
        self._usage: Any = None
        self._finish_reason: Any = None
        self._matched_stop: Any = None

    def add(self, payload: bytes) -> None:
        chunk = orjson.loads(payload)
        if self._head is None:
            self._head = {"id": chunk.get("id"), "object": self.object_name, "created": chunk.get("created"),
                          "model": chunk.get("model")}
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            self._finish_reason = choice.get("finish_reason") or self._finish_reason
            if "matched_stop" in choice:
                self._matched_stop = choice["matched_stop"]
            self._add_choice(choice)

    def body(self) -> bytes:
        head = self._head or {"id": None, "object": self.object_name, "created": None, "model": None}
        return orjson.dumps({**head, "choices": [self._choice()], "usage": self._usage})

    def _add_choice(self, choice: dict[str, Any]) -> None:
        raise NotImplementedError

    def _choice(self) -> dict[str, Any]:
        raise NotImplementedError


class ChatAssembler(_OpenAIAssembler):
    object_name = "chat.completion"

    def __init__(self) -> None:
        super().__init__()
        self._role = "assistant"
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._logprobs: list[Any] = []

    def _add_choice(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        self._role = delta.get("role") or self._role
        if delta.get("content"):
            self._content.append(delta["content"])
        if delta.get("reasoning_content"):
            self._reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or ():
            self._merge_tool_call(call)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and logprobs.get("content"):
            self._logprobs.extend(logprobs["content"])

    def _merge_tool_call(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", len(self._tool_calls))
        call = self._tool_calls.setdefault(index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""

    def _choice(self) -> dict[str, Any]:
        tool_calls = [self._tool_calls[i] for i in sorted(self._tool_calls)] or None
        message = {"role": self._role,
                   "content": "".join(self._content) if self._content or not tool_calls else None,
                   "reasoning_content": "".join(self._reasoning) or None, "tool_calls": tool_calls}
        return {"index": 0, "message": message, "logprobs": {"content": self._logprobs} if self._logprobs else None,
                "finish_reason": self._finish_reason, "matched_stop": self._matched_stop}


class CompletionAssembler(_OpenAIAssembler):
    object_name = "text_completion"

    def __init__(self) -> None:
        super().__init__()
        self._text: list[str] = []
        self._logprobs: dict[str, list[Any]] | None = None

    def _add_choice(self, choice: dict[str, Any]) -> None:
        self._text.append(choice.get("text") or "")
        part = choice.get("logprobs")
        if isinstance(part, dict) and part:
            self._logprobs = self._logprobs or {key: [] for key in part}
            for key, values in part.items():
                if isinstance(values, list):
                    self._logprobs.setdefault(key, []).extend(values)

    def _choice(self) -> dict[str, Any]:
        return {"index": 0, "text": "".join(self._text), "logprobs": self._logprobs,
                "finish_reason": self._finish_reason, "matched_stop": self._matched_stop}
