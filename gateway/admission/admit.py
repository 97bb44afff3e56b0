"""Admission: count the prompt exactly as the engine will, and refuse with 413 what does not fit.

Runs before any byte reaches an engine. The limits come from the model's `PromptLimits`, which the KV-pool gate
lowers to what the running engines' pools safely hold.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import Any

from gateway.admission.chat_template import ChatTemplate
from gateway.admission.counting import TokenCounter, UnencodableText
from gateway.admission.requests import ClientRequest
from gateway.errors import bad_request, context_length_exceeded


_RENDER_INLINE_CHARS = 64 * 1024


@dataclass(slots=True)
class PromptLimits:
    """What one model admits. `prompt_tokens` is min(configured limit, every worker's max_req_input_len - 1)."""

    prompt_tokens: int
    context_length: int
    default_output_tokens: int
    max_output_tokens: int | None = None
    # Smallest decode KV pool among the model's workers: prompt + output must fit it.
    decode_pool_tokens: int | None = None


@dataclass(slots=True)
class AdmittedRequest:
    request: ClientRequest
    prompt_tokens: int
    max_new_tokens: int

    def engine_body(self) -> dict[str, Any]:
        """The body for both engines, minus the gateway-owned rid/bootstrap fields the lifecycle adds."""
        body = dict(self.request.body)
        if self.request.route == "/generate":
            body["sampling_params"] = {**body.get("sampling_params", {}), "max_new_tokens": self.max_new_tokens}
        else:
            body["max_tokens"] = self.max_new_tokens
        return body


class Admission:
    """Counts and checks one model's prompts."""

    def __init__(self, model: str, counter: TokenCounter, template: ChatTemplate, limits: PromptLimits) -> None:
        self.model = model
        self.counter = counter
        self.template = template
        self.limits = limits

    async def admit(self, request: ClientRequest, *, tenant: str) -> AdmittedRequest:
        limits = self.limits
        prompt_tokens = await self._count(request, tenant=tenant, limit=limits.prompt_tokens)
        param = "messages" if request.messages is not None else ("text" if request.route == "/generate" else "prompt")
        if prompt_tokens > limits.prompt_tokens:
            raise context_length_exceeded(
                f"Prompt is too long for model {self.model!r}: {prompt_tokens} tokens counted, the limit is "
                f"{limits.prompt_tokens} prompt tokens.", param=param)
        return AdmittedRequest(request, prompt_tokens, self._output_tokens(request, prompt_tokens, param))

    def _output_tokens(self, request: ClientRequest, prompt_tokens: int, param: str) -> int:
        limits = self.limits
        # SGLang refuses prompt + max_new_tokens >= context_length; a decode pool must hold prompt + output.
        room = limits.context_length - 1 - prompt_tokens
        if limits.decode_pool_tokens is not None:
            room = min(room, limits.decode_pool_tokens - prompt_tokens)
        requested = request.max_tokens
        if requested is None:
            if room < 1:
                raise context_length_exceeded(
                    f"Prompt of {prompt_tokens} tokens leaves no room for output in model {self.model!r} "
                    f"(context length {limits.context_length} tokens).", param=param)
            return min(limits.default_output_tokens, room)
        if limits.max_output_tokens is not None and requested > limits.max_output_tokens:
            raise bad_request(f"max_tokens is {requested}; model {self.model!r} allows at most "
                              f"{limits.max_output_tokens} output tokens", param="max_tokens")
        if requested > room:
            raise context_length_exceeded(
                f"Prompt ({prompt_tokens} tokens) plus requested output ({requested} tokens) does not fit model "
                f"{self.model!r}: context length is {limits.context_length} tokens"
                + (f", decode KV pool is {limits.decode_pool_tokens} tokens" if limits.decode_pool_tokens else "")
                + ".", param="max_tokens")
        return requested

    async def _count(self, request: ClientRequest, *, tenant: str, limit: int) -> int:
        if request.prompt_ids is not None:
            return len(request.prompt_ids)
        if request.messages is not None:
            render = partial(self.template.render, request.messages, tools=request.tools,
                             extra=request.template_kwargs)
            # Rendering holds the GIL either way; in a thread the event loop still runs at every GIL switch.
            large = sum(len(m.get("content") or "") for m in request.messages
                        if isinstance(m.get("content"), str)) > _RENDER_INLINE_CHARS
            text = await asyncio.get_running_loop().run_in_executor(None, render) if large else render()
        else:
            text = request.prompt_text or ""
        try:
            return await self.counter.count(text, tenant=tenant, add_special_tokens=request.add_special_tokens,
                                            limit=limit)
        except UnencodableText as exc:
            raise bad_request(f"prompt cannot be tokenized: {exc}") from exc
