"""SGLang's request parsing and response/stream/error shapes for the three generation APIs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from .config import EngineConfig
from .tokenizer import PromptTokenizer


@dataclass(slots=True)
class PromptSpec:
    text: str | None = None
    messages: list[Any] | None = None
    input_ids: list[int] | None = None
    tools: list[Any] | None = None
    template_kwargs: dict[str, Any] | None = None
    max_new: int | None = None
    stream: bool = False
    include_usage: bool = False
    model: str | None = None


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _openai_error(status: int, msg: str, err_type: str) -> dict[str, Any]:
    return {"object": "error", "message": msg, "type": err_type, "param": None, "code": status}


def _ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError("input_ids must be a list of integers (batch requests are not emulated)")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer")
    return value


class StreamState:
    __slots__ = ("rid", "created", "model", "ids", "text", "include_usage", "gen", "frame")

    def __init__(self, gen: Any, model: str, include_usage: bool) -> None:
        self.gen = gen
        self.rid = gen.rid
        self.created = int(time.time())
        self.model = model
        self.ids: list[int] = []
        self.text = ""
        self.include_usage = include_usage
        self.frame: tuple[bytes, bytes] | None = None  # cached chunk bytes around the delta


class Format:
    default_max_new = 128

    def parse(self, body: dict[str, Any]) -> PromptSpec:
        raise NotImplementedError

    async def tokenize(self, tok: PromptTokenizer, spec: PromptSpec) -> list[int]:
        if spec.input_ids is not None:
            return spec.input_ids
        if spec.messages is not None:
            return await tok.encode_chat(spec.messages, spec.tools, spec.template_kwargs)
        assert spec.text is not None
        return await tok.encode_text(spec.text)

    def error_body(self, status: int, msg: str, validation: bool = False) -> bytes:
        raise NotImplementedError

    def ok_body(self, gen: Any, text: str, finish: dict[str, Any], spec: PromptSpec, cfg: EngineConfig) -> bytes:
        raise NotImplementedError

    def stream_state(self, gen: Any, spec: PromptSpec, cfg: EngineConfig) -> StreamState:
        return StreamState(gen, spec.model or cfg.model, spec.include_usage)

    def stream_head(self, st: StreamState) -> list[bytes]:
        return []

    def stream_token(self, st: StreamState, index: int, delta: str, finish: dict[str, Any] | None) -> bytes:
        raise NotImplementedError

    def stream_tail(self, st: StreamState) -> list[bytes]:
        return []

    def stream_error(self, status: int, msg: str) -> bytes:
        raise NotImplementedError


def _prompt_tokens(gen: Any) -> int:
    # a stub keeps len(origin_input_ids) == 1 (the prefill in bug mode reports it so)
    return len(gen.kv_ids)


class NativeFormat(Format):
    def parse(self, body: dict[str, Any]) -> PromptSpec:
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ValueError("sampling_params must be an object (batch requests are not emulated)")
        spec = PromptSpec(max_new=_opt_int(sp.get("max_new_tokens"), "max_new_tokens"),
                          stream=bool(body.get("stream", False)))
        if body.get("input_ids") is not None:
            spec.input_ids = _ids(body["input_ids"])
        elif isinstance(body.get("text"), str):
            spec.text = body["text"]
        else:
            raise ValueError("Either text or input_ids should be provided (a string or a list of ints).")
        return spec

    def error_body(self, status: int, msg: str, validation: bool = False) -> bytes:
        if validation:
            return orjson.dumps(_openai_error(400, msg, "Bad Request"))
        if status == 400:
            return orjson.dumps({"error": {"message": msg}})
        return orjson.dumps(_openai_error(status, msg, str(status)))

    def _meta(self, gen: Any, finish: dict[str, Any] | None, n: int) -> dict[str, Any]:
        return {"id": gen.rid, "finish_reason": finish, "prompt_tokens": _prompt_tokens(gen),
                "weight_version": "default", "total_retractions": 0, "completion_tokens": n, "cached_tokens": 0,
                "e2e_latency": time.time() - gen.rec.arrival}

    def ok_body(self, gen: Any, text: str, finish: dict[str, Any], spec: PromptSpec, cfg: EngineConfig) -> bytes:
        out = gen.output if finish.get("type") != "abort" else []
        return orjson.dumps({"text": text, "output_ids": out, "meta_info": self._meta(gen, finish, len(out))})

    def stream_token(self, st: StreamState, index: int, delta: str, finish: dict[str, Any] | None) -> bytes:
        if index >= 0:  # cumulative text and output_ids, as with --stream-output off
            st.ids.append(st.gen.output[index])
            st.text += delta
        return _sse({"text": st.text, "output_ids": st.ids, "meta_info": self._meta(st.gen, finish, len(st.ids))})

    def stream_error(self, status: int, msg: str) -> bytes:
        return _sse({"error": {"message": msg}})


def _openai_finish(finish: dict[str, Any] | None) -> str | None:
    if finish is None:
        return None
    return "abort" if finish["type"] == "abort" else finish["type"]


class _OpenAIFormat(Format):
    obj = ""
    chunk_obj = ""

    def _common(self, body: dict[str, Any], spec: PromptSpec) -> None:
        spec.stream = bool(body.get("stream", False))
        so = body.get("stream_options")
        spec.include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        spec.model = body.get("model") if isinstance(body.get("model"), str) else None

    def error_body(self, status: int, msg: str, validation: bool = False) -> bytes:
        if validation:
            return orjson.dumps(_openai_error(400, msg, "Bad Request"))
        err_type = "BadRequestError" if status == 400 else str(status)
        return orjson.dumps(_openai_error(status, msg, err_type))

    def stream_error(self, status: int, msg: str) -> bytes:
        err_type = "BadRequestError" if status == 400 else str(status)
        return _sse({"error": _openai_error(status, msg, err_type)})

    def _usage(self, prompt: int, completion: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                "prompt_tokens_details": None, "reasoning_tokens": 0}

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def ok_body(self, gen: Any, text: str, finish: dict[str, Any], spec: PromptSpec, cfg: EngineConfig) -> bytes:
        n = len(gen.output) if finish.get("type") != "abort" else 0
        return orjson.dumps({"id": gen.rid, "object": self.obj, "created": int(time.time()),
                             "model": spec.model or cfg.model, "choices": [self._choice(text, _openai_finish(finish))],
                             "usage": self._usage(_prompt_tokens(gen), n),
                             "metadata": {"weight_version": "default"}})

    def _chunk(self, st: StreamState, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        return _sse({"id": st.rid, "object": self.chunk_obj, "created": st.created, "model": st.model,
                     "choices": choices, "usage": usage})

    def stream_tail(self, st: StreamState) -> list[bytes]:
        if not st.include_usage:  # the optional usage chunk has no choices
            return []
        return [self._chunk(st, [], self._usage(_prompt_tokens(st.gen), len(st.ids)))]


class ChatFormat(_OpenAIFormat):
    obj = "chat.completion"
    chunk_obj = "chat.completion.chunk"

    def parse(self, body: dict[str, Any]) -> PromptSpec:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: Field required (a non-empty list)")
        spec = PromptSpec(messages=messages)
        spec.max_new = _opt_int(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens")
        tools = body.get("tools")
        spec.tools = tools if isinstance(tools, list) else None
        kw = body.get("chat_template_kwargs")
        spec.template_kwargs = kw if isinstance(kw, dict) else None
        if (body.get("n") or 1) != 1:
            raise ValueError("n > 1 (batch requests) is not emulated")
        self._common(body, spec)
        return spec

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                        "tool_calls": None},
                "logprobs": None, "finish_reason": finish, "matched_stop": None}

    def _delta(self, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": None}

    def stream_head(self, st: StreamState) -> list[bytes]:
        return [self._chunk(st, [self._delta({"role": "assistant", "content": ""}, None)])]

    def stream_token(self, st: StreamState, index: int, delta: str, finish: dict[str, Any] | None) -> bytes:
        out = b""
        if index >= 0:
            st.ids.append(index)
            if st.frame is None:  # per-token chunks differ only in the delta: splice it into a cached frame
                head, _, tail = self._chunk(st, [self._delta({"content": "\x00"}, None)]).partition(b'"\\u0000"')
                st.frame = (head, tail)
            out = st.frame[0] + orjson.dumps(delta) + st.frame[1]
        if finish is not None:  # the finish reason comes in its own chunk with an empty delta
            out += self._chunk(st, [self._delta({}, _openai_finish(finish))])
        return out


class CompletionFormat(_OpenAIFormat):
    obj = "text_completion"
    chunk_obj = "text_completion"
    default_max_new = 16  # CompletionRequest.max_tokens default

    def parse(self, body: dict[str, Any]) -> PromptSpec:
        prompt = body.get("prompt")
        spec = PromptSpec()
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            spec.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            spec.input_ids = _ids(prompt)
        else:
            raise ValueError("prompt: a string, a one-string list or a list of token ids (batches are not emulated)")
        spec.max_new = _opt_int(body.get("max_tokens"), "max_tokens")
        self._common(body, spec)
        return spec

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": None}

    def stream_token(self, st: StreamState, index: int, delta: str, finish: dict[str, Any] | None) -> bytes:
        if index >= 0:
            st.ids.append(index)
        return self._chunk(st, [self._choice(delta, _openai_finish(finish))])


NATIVE = NativeFormat()
CHAT = ChatFormat()
COMPLETION = CompletionFormat()
