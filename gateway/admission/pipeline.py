"""A request body → an admitted request: parse, reduce, count, check. The same steps run on the event loop for
small bodies and in an admission worker process for large ones (`gateway.admission.offload`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from gateway.admission.admit import Admission, AdmittedRequest, PromptLimits
from gateway.admission.chat import ChatSettings, default_template_kwargs
from gateway.admission.chat_template import ChatTemplate
from gateway.admission.counting import INLINE_CHARS, TokenCounter
from gateway.admission.dialects import Dialect
from gateway.admission.requests import Route, decode_json_object, parse_request, reject_unknown_model, requested_model
from gateway.admission.tokenizer import ModelTokenizer
from gateway.config import ModelConfig
from gateway.errors import GatewayError, bad_request, model_unavailable

M = TypeVar("M")
OFF_LOOP_BYTES = 8 * 1024


class AdmittingModel(Protocol):
    """What admission needs of a served model."""

    @property
    def admission(self) -> Admission: ...

    @property
    def chat_settings(self) -> ChatSettings: ...

    def dialects(self) -> frozenset[Dialect]: ...


async def admit_body(route: Route, raw: bytes, *, tenant: str,
                     find_model: Callable[[str | None], AdmittingModel]) -> AdmittedRequest:
    """`find_model` raises the 404/503 for a model that is unknown or not served."""
    data = decode_json_object(raw)
    model = find_model(requested_model(route, data))
    # Above a few KiB, reducing, rendering and checking move to a thread: pure-Python work there lets the loop run
    # at every GIL hand-over, and no body small enough to stay in this process holds the GIL long in one call.
    off_loop = len(raw) > OFF_LOOP_BYTES
    try:
        if off_loop:
            request = await asyncio.get_running_loop().run_in_executor(None, parse_request, route, data,
                                                                       model.chat_settings)
        else:
            request = parse_request(route, data, model.chat_settings)
        return await model.admission.admit(request, tenant=tenant, dialects=model.dialects(), off_loop=off_loop)
    except GatewayError as error:
        error.model = model.admission.model
        raise


def resolve_model(name: str | None, models: Mapping[str, M], unavailable: Callable[[M], str | None]) -> M:
    """The model a request names (or the only one served): 400 when ambiguous, 404 unknown, 503 not served."""
    if name is None:
        if len(models) != 1:
            raise bad_request("model is required when the gateway serves several models", param="model")
        name = next(iter(models))
    model = models.get(name)
    if model is None:
        raise reject_unknown_model(name, list(models))
    reason = unavailable(model)
    if reason:
        raise model_unavailable(name, reason)
    return model


def build_admission(config: ModelConfig, *, cache_bytes: int) -> Admission:
    """Load the model's tokenizer and chat template (slow: call off the event loop)."""
    tokenizer = ModelTokenizer.load(config.tokenizer)
    template = ChatTemplate.for_tokenizer(config.tokenizer, config.chat_template)
    allowed = (frozenset(config.chat_template_kwargs) if config.chat_template_kwargs is not None
               else default_template_kwargs(template.variables_read))
    limits = PromptLimits(prompt_tokens=config.configured_prompt_limit, context_length=config.context_length,
                          default_output_tokens=config.default_max_tokens, max_output_tokens=config.max_output_tokens)
    routing = config.routing
    prefix_tokens = routing.prefix_tokens if "prefix_affinity" in (routing.prefill_policy, routing.decode_policy) \
        else None
    route_tokens = routing.cache_aware_tokens if routing.prefill_policy == "cache_aware" else None
    # Short prompts are encoded whole — unless the cache-aware policy's routing ids, encoded first, leave their
    # counts in the cache for the count to take.
    counter = TokenCounter(tokenizer, cache_bytes=cache_bytes, single_pass_chars=0 if route_tokens else INLINE_CHARS)
    return Admission(config.name, tokenizer, counter, template,
                     ChatSettings(template.content_format, allowed), limits, prefix_tokens=prefix_tokens,
                     route_tokens=route_tokens)
