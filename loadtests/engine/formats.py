"""What every generation API shares, and the native `/generate` request, response, stream and error shapes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from .chat_prompt import ChatPrompt
from .config import EngineConfig
from .errors import HTTPError
from .tokenizer import PromptTokenizer

BAD_REQUEST = "Bad Request"  # the `type` of FastAPI request-validation errors, which SGLang turns into 400s


@dataclass(slots=True)
class PromptSpec:
    text: str | None = None
    chat: ChatPrompt | None = None
    input_ids: list[int] | None = None
    max_new: int | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a final chunk with the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on the content chunks
    model: str = "default"
    return_logprob: bool = False  # /generate: meta_info carries input_/output_token_logprobs
    output_logprobs: int | None = None  # OpenAI routes: output logprobs with this many alternatives (non-streaming)
    echo: bool = False  # /v1/completions: the prompt's text leads the answer


def fake_logprob(token_id: int) -> float:
    """A deterministic stand-in for a token's log-probability."""
    return -((token_id % 997) + 1) / 100


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def openai_error(status: int, msg: str, err_type: str) -> dict[str, Any]:
    return {"object": "error", "message": msg, "type": err_type, "param": None, "code": status}


def prompt_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError("input_ids must be a list of integers (batch requests are not emulated)")
    if not value:
        raise HTTPError(400, "input_ids cannot be empty.")  # GenerateReqInput._determine_batch_size
    return value


def reported_prompt_tokens(gen: Any) -> int:
    """`len(origin_input_ids)` (a bug-mode stub keeps 1, unless a lying engine hides it), shifted by an injected
    `miscount` fault."""
    return len(gen.input_ids if gen.hide_stub else gen.kv_ids) + gen.prompt_offset


class StreamState:
    __slots__ = (
        "continuous_usage",
        "created",
        "echo_text",
        "frame",
        "gen",
        "ids",
        "include_usage",
        "model",
        "output_logprobs",
        "return_logprob",
        "rid",
        "text",
    )

    def __init__(self, gen: Any, spec: PromptSpec) -> None:
        self.gen = gen
        self.rid = gen.rid
        self.created = int(time.time())
        self.model = spec.model
        self.ids: list[int] = []
        self.text = ""
        self.include_usage = spec.include_usage
        self.continuous_usage = spec.continuous_usage
        self.return_logprob = spec.return_logprob
        self.output_logprobs = spec.output_logprobs
        self.echo_text = ""  # /v1/completions with echo: leads the first chunk's text
        self.frame: tuple[bytes, ...] | None = None  # cached chunk bytes around the per-token parts


class Format:
    default_max_new = 128

    def parse(self, body: dict[str, Any]) -> PromptSpec:
        """The request's prompt and options; raises HTTPError (or ValueError, a 400) as SGLang rejects it."""
        raise NotImplementedError

    async def tokenize(self, tok: PromptTokenizer, spec: PromptSpec) -> list[int]:
        if spec.input_ids is not None:
            return spec.input_ids
        if spec.chat is not None:
            return await tok.encode_chat(spec.chat)
        assert spec.text is not None
        return await tok.encode_text(spec.text)

    def error_body(self, status: int, msg: str, err_type: str | None = None) -> bytes:
        raise NotImplementedError

    def ok_body(self, gen: Any, text: str, finish: dict[str, Any], spec: PromptSpec, cfg: EngineConfig) -> bytes:
        raise NotImplementedError

    def stream_head(self, st: StreamState) -> list[bytes]:
        return []

    def stream_token(self, st: StreamState, index: int, delta: str, finish: dict[str, Any] | None) -> bytes:
        raise NotImplementedError

    def stream_tail(self, st: StreamState) -> list[bytes]:
        return []

    def stream_error(self, status: int, msg: str) -> bytes:
        raise NotImplementedError


class NativeFormat(Format):
    def parse(self, body: dict[str, Any]) -> PromptSpec:
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ValueError("sampling_params must be an object (batch requests are not emulated)")
        max_new = sp.get("max_new_tokens")
        if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0):
            raise ValueError("max_new_tokens must be a non-negative integer")
        spec = PromptSpec(max_new=max_new, stream=bool(body.get("stream", False)),
                          return_logprob=body.get("return_logprob") is True)
        if body.get("input_ids") is not None:  # input_ids win over text
            spec.input_ids = prompt_ids(body["input_ids"])
        elif isinstance(body.get("text"), str):
            spec.text = body["text"]
        else:
            raise ValueError("Either text or input_ids should be provided (a string or a list of ints).")
        return spec

    def error_body(self, status: int, msg: str, err_type: str | None = None) -> bytes:
        if err_type is not None:
            return orjson.dumps(openai_error(status, msg, err_type))
        if status == 400:  # a ValueError from the tokenizer manager
            return orjson.dumps({"error": {"message": msg}})
        return orjson.dumps(openai_error(status, msg, str(status)))

    def _meta(self, gen: Any, finish: dict[str, Any] | None, out: list[int], logprob: bool) -> dict[str, Any]:
        meta = {"id": gen.rid, "finish_reason": finish, "prompt_tokens": reported_prompt_tokens(gen),
                "weight_version": "default", "total_retractions": 0, "completion_tokens": len(out),
                "cached_tokens": gen.rec.cached_tokens,
                "e2e_latency": time.time() - gen.rec.arrival}
        if logprob:
            # In PD only the prefill computes the prompt's logprobs (the first token has none); a router prepends
            # them to the decode's (SGLang's router: merge_logprobs_in_json).
            prompt = gen.input_ids if gen.rec.role == "prefill" else []
            meta["input_token_logprobs"] = [[None if i == 0 else fake_logprob(t), t, None]
                                            for i, t in enumerate(prompt)]
            meta["output_token_logprobs"] = [[fake_logprob(t), t, None] for t in out]
        return meta

    def ok_body(self, gen: Any, text: str, finish: dict[str, Any], spec: PromptSpec, cfg: EngineConfig) -> bytes:
        out = gen.output if finish.get("type") != "abort" else []
        return orjson.dumps({"text": text, "output_ids": out,
                             "meta_info": self._meta(gen, finish, out, spec.return_logprob)})

    def stream_token(self, st: StreamState, index: int, delta: str, finish: dict[str, Any] | None) -> bytes:
        if index >= 0:  # cumulative text and output_ids, as with --stream-output off
            st.ids.append(st.gen.output[index])
            st.text += delta
        return sse({"text": st.text, "output_ids": st.ids,
                    "meta_info": self._meta(st.gen, finish, st.ids, st.return_logprob)})

    def stream_error(self, status: int, msg: str) -> bytes:
        return sse({"error": {"message": msg}})
