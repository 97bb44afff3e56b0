"""`/v1/chat/completions` and `/v1/completions`: request parsing and the response, stream and usage shapes per dialect.

Chunks are byte-for-byte what SGLang writes: pydantic `model_dump_json()` (0.5.8 chat; completions; usage-only chunks,
`exclude_none` for the completions one) or, for 0.5.22+ chat role/content/finish chunks, msgspec's `StreamChunk`
(`sse_utils.py: build_sse_content`: no `usage` key unless set, `reasoning_content` first in the delta).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from .chat_prompt import build_prompt, check_request
from .config import EngineConfig
from .dialect import Dialect
from .errors import HTTPError
from .formats import (
    BAD_REQUEST,
    Format,
    PromptSpec,
    StreamState,
    fake_logprob,
    openai_error,
    prompt_ids,
    reported_prompt_tokens,
    sse,
)
from .openai_models import models_for

# stand-ins for the delta and the usage in the cached content-chunk frame
_CONTENT_MARK = b'"\\u0000"'
_USAGE_MARK = b'"\\u0001"'

_MEMO_ENTRIES = 1024
_MEMO_MAX_BYTES = 16_384
# per-request fields a router sets; any value of these types validates alike
_ROUTING_TYPES = {"rid": (str, type(None)), "bootstrap_host": (str, type(None)), "bootstrap_port": (int, type(None)),
                  "bootstrap_room": (int, type(None))}


def _validation_message(e: ValidationError) -> str:
    """FastAPI's RequestValidationError text as SGLang's handler joins it (`str(exc)` and `str(exc.errors())`)."""
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
    head = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:\n"
    return head + "".join(f"  {err}\n" for err in errors).rstrip() + f" {errors}"


def _memo_key(body: dict[str, Any]) -> bytes | None:
    rest = {}
    for k, v in body.items():
        types = _ROUTING_TYPES.get(k)
        if types is None:
            rest[k] = v
        elif not isinstance(v, types) or isinstance(v, bool):
            return None
    key = orjson.dumps(rest)
    return key if len(key) <= _MEMO_MAX_BYTES else None


def _error_type(status: int) -> str:
    """A ValueError from generation is `create_error_response`'s default type; an HTTPException keeps its code."""
    return "BadRequestError" if status == 400 else str(status)


def _finish_type(finish: dict[str, Any] | None) -> str | None:
    return None if finish is None else finish["type"]


class OpenAIFormat(Format):
    obj = ""
    chunk_obj = ""

    def __init__(self, dialect: Dialect, model: type[BaseModel]) -> None:
        self.dialect = dialect
        self.model = model
        self.cache_report = False  # --enable-cache-report

    def _validate(self, body: dict[str, Any]) -> Any:
        try:
            return self.model.model_validate(body)
        except ValidationError as e:
            raise HTTPError(400, _validation_message(e), BAD_REQUEST) from None

    def _options(self, req: Any, spec: PromptSpec) -> None:
        if req.n != 1:
            raise ValueError("n > 1 (batch requests) is not emulated")
        spec.stream = req.stream
        spec.model = req.model
        so = req.stream_options
        spec.include_usage = bool(so and so.include_usage)
        spec.continuous_usage = bool(so and so.continuous_usage_stats)

    def error_body(self, status: int, msg: str, err_type: str | None = None) -> bytes:
        return orjson.dumps(openai_error(status, msg, err_type or _error_type(status)))

    def stream_error(self, status: int, msg: str) -> bytes:
        return sse({"error": openai_error(status, msg, _error_type(status))})

    def usage(self, prompt: int, completion: int, details: dict[str, int] | None = None) -> dict[str, Any]:
        """UsageInfo as pydantic dumps it (0.5.23 added completion_tokens_details)."""
        u = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
             "prompt_tokens_details": details, "reasoning_tokens": 0}
        if self.dialect >= Dialect.V0_5_23:
            u["completion_tokens_details"] = None
        return u

    def cached_details(self, gen: Any) -> dict[str, int] | None:
        """`prompt_tokens_details` of a response's usage and of the final usage chunk, with --enable-cache-report
        only (UsageProcessor): 0.5.8 `{"cached_tokens": N}` only when N > 0 (`_details_if_cached`), 0.5.22+ always
        (`PromptTokensDetails`, its absent multimodal counts dropped)."""
        if not self.cache_report:
            return None
        cached = gen.rec.cached_tokens
        if self.dialect < Dialect.V0_5_22:
            return {"cached_tokens": cached} if cached > 0 else None
        return {"cached_tokens": cached}

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def ok_body(self, gen: Any, text: str, finish: dict[str, Any], spec: PromptSpec, cfg: EngineConfig) -> bytes:
        n = len(gen.output) if finish.get("type") != "abort" else 0
        choice = self._choice(text, _finish_type(finish))
        if spec.output_logprobs is not None and finish.get("type") != "abort":
            choice["logprobs"] = self._logprobs(gen.output, spec.output_logprobs)
        return orjson.dumps({"id": gen.rid, "object": self.obj, "created": int(time.time()), "model": spec.model,
                             "choices": [choice],
                             "usage": self.usage(reported_prompt_tokens(gen), n, self.cached_details(gen)),
                             "metadata": {"weight_version": "default"}})

    def _logprobs(self, ids: list[int], alternatives: int) -> dict[str, Any]:
        raise NotImplementedError

    def _usage_chunk(self, st: StreamState, usage: dict[str, Any]) -> bytes:
        return sse({"id": st.rid, "object": self.chunk_obj, "created": st.created, "model": st.model, "choices": [],
                    "usage": usage})


class ChatFormat(OpenAIFormat):
    obj = "chat.completion"
    chunk_obj = "chat.completion.chunk"

    def __init__(self, dialect: Dialect, context_length: int, content_format: str,
                 default_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(dialect, models_for(dialect).chat)
        self.context_length = context_length
        self.content_format = content_format
        self.default_template_kwargs = default_template_kwargs if dialect >= Dialect.V0_5_22 else None
        self._memo: OrderedDict[bytes, PromptSpec] = OrderedDict()

    def parse(self, body: dict[str, Any]) -> PromptSpec:
        """Parsing is deterministic in the body, so a repeated body (up to its routing fields) shares the result
        (specs are read-only once parsed)."""
        key = _memo_key(body)
        hit = self._memo.get(key) if key is not None else None
        if hit is not None:
            return hit
        spec = self._parse(body)
        if key is not None:
            self._memo[key] = spec
            if len(self._memo) > _MEMO_ENTRIES:
                self._memo.popitem(last=False)
        return spec

    def _parse(self, body: dict[str, Any]) -> PromptSpec:
        req = self._validate(body)
        try:
            err = check_request(req, self.dialect, self.context_length)
            if err is not None:
                raise HTTPError(400, err, "BadRequestError")
            chat = build_prompt(req, self.dialect, self.content_format, self.default_template_kwargs)
            spec = PromptSpec(chat=chat)
            if chat.input_ids is not None and not chat.input_ids:
                raise HTTPError(400, "input_ids cannot be empty.", "BadRequestError")
            self._options(req, spec)
            if req.logprobs:
                spec.output_logprobs = req.top_logprobs or 0
        except HTTPError:
            raise
        except ValueError as e:  # OpenAIServingBase.handle_request
            raise HTTPError(400, str(e), "BadRequest") from e
        except Exception as e:
            raise HTTPError(500, f"Internal server error: {e}", "InternalServerError") from e
        # to_sampling_params: 0.5.8 prefers max_tokens, 0.5.22+ max_completion_tokens; 0 means unset
        first, second = ((req.max_tokens, req.max_completion_tokens) if self.dialect < Dialect.V0_5_22
                         else (req.max_completion_tokens, req.max_tokens))
        spec.max_new = first or second
        if spec.max_new is not None and spec.max_new < 0:  # SamplingParams.verify
            raise HTTPError(400, f"max_new_tokens must be at least 0, got {spec.max_new}.", "BadRequestError")
        return spec

    def _logprobs(self, ids: list[int], alternatives: int) -> dict[str, Any]:
        """ChoiceLogprobs: one entry per output token (token strings are stand-ins: `<id>`)."""
        def entry(token_id: int) -> dict[str, Any]:
            token = f"<{token_id}>"
            return {"token": token, "bytes": list(token.encode()), "logprob": fake_logprob(token_id)}
        return {"content": [{**entry(t), "top_logprobs": [entry(t + k) for k in range(alternatives)]} for t in ids]}

    def _message(self, content: str | None) -> dict[str, Any]:
        msg = {"role": "assistant", "content": content, "reasoning_content": None, "tool_calls": None}
        if self.dialect >= Dialect.V0_5_22:  # ChatMessage drops a null tool_calls
            del msg["tool_calls"]
        return msg

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "message": self._message(text or None), "logprobs": None, "finish_reason": finish,
                "matched_stop": None}

    def _chunk(self, st: StreamState, delta: dict[str, Any], finish: str | None, usage: Any = None,
               logprobs: Any = None) -> bytes:
        """One role/content/finish chunk: pydantic's layout on 0.5.8, msgspec's `build_sse_content` on 0.5.22+."""
        chunk: dict[str, Any] = {"id": st.rid, "object": self.chunk_obj, "created": st.created, "model": st.model}
        if self.dialect < Dialect.V0_5_22:
            full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None, **delta}
        else:
            full = {"reasoning_content": None, **delta}
        chunk["choices"] = [{"index": 0, "delta": full, "logprobs": logprobs, "finish_reason": finish,
                             "matched_stop": None}]
        if usage is not None or self.dialect < Dialect.V0_5_22:
            chunk["usage"] = usage
        return sse(chunk)

    def stream_head(self, st: StreamState) -> list[bytes]:
        return [self._chunk(st, {"role": "assistant", "content": ""}, None)]  # never carries usage

    def stream_token(self, st: StreamState, index: int, delta: str, finish: dict[str, Any] | None) -> bytes:
        out = b""
        if index >= 0 and st.output_logprobs is not None:  # per-token logprobs: no cached frame
            st.ids.append(index)
            usage = self._running_usage(st) if st.continuous_usage else None
            out = self._chunk(st, {"content": delta}, None, usage, self._logprobs([index], st.output_logprobs))
        elif index >= 0:
            st.ids.append(index)
            if st.frame is None:  # content chunks differ only in the delta (and usage): splice into a cached frame
                usage = "\x01" if st.continuous_usage else None
                head, _, rest = self._chunk(st, {"content": "\x00"}, None, usage).partition(_CONTENT_MARK)
                st.frame = (head, *rest.partition(_USAGE_MARK)[::2]) if st.continuous_usage else (head, rest)
            if st.continuous_usage:
                usage_json = orjson.dumps(self._running_usage(st))
                out = st.frame[0] + orjson.dumps(delta) + st.frame[1] + usage_json + st.frame[2]
            else:
                out = st.frame[0] + orjson.dumps(delta) + st.frame[1]
        if finish is not None:  # the finish reason comes in its own chunk with an empty delta
            out += self._chunk(st, {}, _finish_type(finish))
        return out

    def _running_usage(self, st: StreamState) -> dict[str, Any]:
        """continuous_usage_stats: 0.5.22+ adds the cached count (`_continuous_usage_cached_details`), 0.5.8 not."""
        details = self.cached_details(st.gen) if self.dialect >= Dialect.V0_5_22 else None
        return self.usage(reported_prompt_tokens(st.gen), len(st.ids), details)

    def stream_tail(self, st: StreamState) -> list[bytes]:
        if not st.include_usage:
            return []
        usage = self.usage(reported_prompt_tokens(st.gen), len(st.ids), self.cached_details(st.gen))
        return [self._usage_chunk(st, usage)]


class CompletionFormat(OpenAIFormat):
    obj = "text_completion"
    chunk_obj = "text_completion"
    default_max_new = 16  # CompletionRequest.max_tokens default

    def __init__(self, dialect: Dialect) -> None:
        super().__init__(dialect, models_for(dialect).completion)

    def parse(self, body: dict[str, Any]) -> PromptSpec:
        req = self._validate(body)
        prompt = req.prompt
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            raise HTTPError(400, "Prompt cannot be empty", "BadRequestError")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        spec = PromptSpec(max_new=req.max_tokens, echo=req.echo, output_logprobs=req.logprobs)
        if isinstance(prompt, str):
            spec.text = prompt
        elif all(isinstance(t, int) for t in prompt):
            spec.input_ids = prompt_ids(prompt)
        else:
            raise ValueError("prompt: a string or one list of token ids (batches are not emulated)")
        self._options(req, spec)
        return spec

    def _choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": None}

    def _logprobs(self, ids: list[int], alternatives: int) -> dict[str, Any]:
        """LogProbs of the output tokens (the prompt's are never computed on this route)."""
        tokens = [f"<{t}>" for t in ids]
        offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
        return {"text_offset": offsets, "token_logprobs": [fake_logprob(t) for t in ids], "tokens": tokens,
                "top_logprobs": [{f"<{t + k}>": fake_logprob(t + k) for k in range(alternatives)} for t in ids]}

    def stream_token(self, st: StreamState, index: int, delta: str, finish: dict[str, Any] | None) -> bytes:
        choice = self._choice(delta, _finish_type(finish))
        if index >= 0:
            if not st.ids and st.echo_text:  # serving_completions: echo leads the first chunk
                choice["text"] = st.echo_text + delta
            st.ids.append(index)
            if st.output_logprobs is not None:
                choice["logprobs"] = self._logprobs([index], st.output_logprobs)
        usage = self.usage(reported_prompt_tokens(st.gen), len(st.ids)) if st.continuous_usage else None
        return sse({"id": st.rid, "object": self.chunk_obj, "created": st.created, "model": st.model,
                    "choices": [choice], "usage": usage})

    def stream_tail(self, st: StreamState) -> list[bytes]:
        if not st.include_usage:  # model_dump_json(exclude_none=True): the null details vanish
            return []
        full = self.usage(reported_prompt_tokens(st.gen), len(st.ids), self.cached_details(st.gen))
        usage = {k: v for k, v in full.items() if v is not None}
        return [self._usage_chunk(st, usage)]
