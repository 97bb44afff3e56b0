"""Admission: count the prompt exactly as the engines will, refuse with 413 what does not fit, and build the one
engine body that is forwarded — the reduced request that was counted, never the client's raw JSON.

Runs before any byte reaches an engine. The limits come from the model's `PromptLimits`, which the KV-pool gate
lowers to what the running engines' pools safely hold. A chat is rendered once per SGLang dialect among the model's
workers; each engine's own report is later checked against the count for its dialect (verify-then-release).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import orjson

from gateway.admission.chat import ChatPrompt, ChatSettings, RenderPlan
from gateway.admission.chat_template import ChatTemplate, RenderFailed
from gateway.admission.counting import CountResult, TokenCounter, UnencodableText
from gateway.admission.dialects import Dialect, dialect_for
from gateway.admission.prompt_ids import PromptIds
from gateway.admission.requests import ClientRequest, IdsPrompt, Route, TextPrompt, UsageOptions
from gateway.admission.tokenizer import ModelTokenizer
from gateway.errors import bad_request, context_length_exceeded
from routing.prefix_index.blocks import ids_to_bytes
from routing.stable_hash import stable_hash

T = TypeVar("T")
PREFIX_WINDOW_CHARS = 16384  # the most of a prompt read for its prefix hash (~4 ms of encoding)
ROUTE_IDS_INLINE_CHARS = 8192  # longer prompts get their routing ids in a thread (cached pieces make most cheap)


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What one model admits. `prompt_tokens` is min(configured limit, every worker's max_req_input_len - 1)."""

    prompt_tokens: int
    context_length: int
    default_output_tokens: int
    max_output_tokens: int | None = None
    # Smallest decode KV pool among the model's workers: prompt + output must fit it.
    decode_pool_tokens: int | None = None


# A prompt's head for the prefix hash: token ids, or (text, whether the engine adds special tokens to it).
PromptHead = list[Any] | tuple[str, bool]


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    """A request that fits: the engine body to forward and the gateway's own count of its prompt."""

    route: Route
    model: str
    stream: bool
    engine_body: bytes  # a JSON object without the gateway-owned rid, bootstrap_* and stream fields
    prompt_tokens: dict[Dialect, int]
    max_new_tokens: int
    usage: UsageOptions
    prefix_hash: int | None = None  # the prompt's first token ids (and cache_salt), for prefix affinity
    merge_logprobs: bool = False  # /generate with return_logprob: prefill's prompt logprobs go into decode's answer
    cache_salt: str | None = None  # the client's own salt: it only subdivides its tenant's prefix-cache namespace
    # A chat: the engines' default template kwargs it was rendered with (JSON; None: none). Not a chat: unused.
    engine_defaults_json: str | None = None
    # The prompt's first token ids as the engine sees them (routing.prefix_index.blocks.ids_to_bytes), for the
    # cache-aware policy; None when no policy of the model needs them.
    route_ids: bytes | None = None

    def prompt_tokens_for(self, engine_version: str) -> int | None:
        """The gateway's count as an engine of that version renders the prompt (None: not counted for it)."""
        return self.prompt_tokens.get(dialect_for(engine_version))

    @property
    def most_prompt_tokens(self) -> int:
        return max(self.prompt_tokens.values())


class Admission:
    """Counts and checks one model's prompts."""

    def __init__(self, model: str, tokenizer: ModelTokenizer, counter: TokenCounter, template: ChatTemplate,
                 chat: ChatSettings, limits: PromptLimits, *, prefix_tokens: int | None = None,
                 route_tokens: int | None = None) -> None:
        """`prefix_tokens`: hash that many leading token ids of each prompt (a prefix-affinity policy routes by it);
        `route_tokens`: keep that many leading token ids of each prompt (the cache-aware policy matches them)."""
        self.model = model
        self.prefix_tokens = prefix_tokens
        self.route_tokens = route_tokens
        self._prompt_ids = PromptIds(tokenizer, counter.splitter, on_encoded=counter.remember) \
            if route_tokens else None
        self.tokenizer = tokenizer
        self.counter = counter
        self.template = template
        self.chat = chat
        self.limits = limits
        self._vocab_size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        bos = template.special_tokens.get("bos_token")
        self._bos_token_id = tokenizer.token_id(bos) if bos else None

    async def admit(self, request: ClientRequest, *, tenant: str, dialects: frozenset[Dialect],
                    off_loop: bool = False) -> AdmittedRequest:
        """`off_loop`: render, check ids and serialise in a thread (a large body)."""
        limits = self.limits
        results, head, route_ids = await self._count(request, tenant=tenant, limit=limits.prompt_tokens,
                                                     dialects=dialects, off_loop=off_loop)
        worst = max(results.values(), key=lambda result: result.tokens)
        if worst.tokens > limits.prompt_tokens:
            # An early exit knows only a lower bound: it says so rather than state a count it did not make.
            counted = f"{worst.tokens} tokens" if worst.exact else f"more than {limits.prompt_tokens} tokens"
            # OpenAI's wording first: clients (LiteLLM's context-window fallbacks) recognise a too-long prompt by it.
            raise context_length_exceeded(
                f"This model's maximum context length is {limits.prompt_tokens} tokens for the prompt. However, your "
                f"{_prompt_noun(request)} resulted in {counted}. Please reduce the length of the "
                f"{_prompt_noun(request)}. (Prompt is too long for model {self.model!r}: the limit is "
                f"{limits.prompt_tokens} prompt tokens, what the engines' KV pools hold.)", param=request.prompt_param)
        counts = {dialect: result.tokens for dialect, result in results.items()}
        max_new = self._output_tokens(request, worst.tokens)
        fields = dict(request.fields)
        if "token_ids_logprob" in fields:  # ids the engine indexes its logits with: inside the vocabulary
            self._check_ids(fields["token_ids_logprob"], param="token_ids_logprob")
        if request.route == "/generate":
            fields["sampling_params"] = {**fields["sampling_params"], "max_new_tokens": max_new}
        else:
            fields["max_tokens"] = max_new
        body = await _maybe_off_loop(orjson.dumps, fields, large=off_loop)
        prefix = self._prefix_hash(head, request.cache_salt) if self.prefix_tokens else None
        return AdmittedRequest(request.route, self.model, request.stream, body, counts, max_new, request.usage,
                               prefix, merge_logprobs=request.route == "/generate"
                               and fields.get("return_logprob") is True, cache_salt=request.cache_salt,
                               engine_defaults_json=request.prompt.engine_defaults_json
                               if isinstance(request.prompt, ChatPrompt) else None, route_ids=route_ids)

    async def _route_ids(self, head: PromptHead, tenant: str, *, large: bool) -> bytes | None:
        """The prompt's first token ids for cache-aware routing (None when no policy needs them). Made before the
        count: every piece it encodes is handed to the counter's cache, so no text is encoded twice."""
        n, builder = self.route_tokens, self._prompt_ids
        if n is None or builder is None:
            return None
        if isinstance(head, list):
            return ids_to_bytes(head[:n])
        text, special = head
        # New text is encoded (~0.25 µs a character): off the loop once it could take more than a few ms.
        return await _maybe_off_loop(partial(builder.ids, text, tenant=tenant, special=special, max_tokens=n),
                                     large=large or len(text) > ROUTE_IDS_INLINE_CHARS)

    def _prefix_hash(self, head: PromptHead, salt: str | None) -> int:
        """A hash of the prompt's first `prefix_tokens` token ids as the engine sees them, and of cache_salt."""
        n = self.prefix_tokens
        assert n is not None
        if isinstance(head, list):
            ids = head[:n]
        else:
            text, special = head
            # ~4 characters a token in prose; the window widens while it holds too few (encoding costs ~0.25 µs a
            # character, on the event loop), up to 16 KiB characters. Prompts that share their first `window`
            # characters get the same ids, which is all affinity needs.
            window = min(n * 4, PREFIX_WINDOW_CHARS)
            while True:
                ids = self.tokenizer.tokenizer.encode_batch_fast([text[:window]], add_special_tokens=special)[0].ids
                if len(ids) > n or window >= len(text) or window >= PREFIX_WINDOW_CHARS:
                    ids = ids[:n]
                    break
                window = min(window * 2, PREFIX_WINDOW_CHARS)
        salt_bytes = salt.encode() if salt is not None else b""
        return stable_hash(array("q", (int(i) for i in ids)).tobytes(), salt_bytes)

    def _output_tokens(self, request: ClientRequest, prompt_tokens: int) -> int:
        limits = self.limits
        # SGLang refuses prompt + max_new_tokens >= context_length; a decode pool must hold prompt + output.
        room = limits.context_length - 1 - prompt_tokens
        if limits.decode_pool_tokens is not None:
            room = min(room, limits.decode_pool_tokens - prompt_tokens)
        requested = request.max_tokens
        maximum = limits.context_length - 1
        if limits.decode_pool_tokens is not None:
            maximum = min(maximum, limits.decode_pool_tokens)
        if requested is None:
            if room < 1:
                raise context_length_exceeded(
                    f"This model's maximum context length is {maximum} tokens. However, your "
                    f"{_prompt_noun(request)} resulted in {prompt_tokens} tokens, which leaves no room for the "
                    "completion. Please reduce the length of the messages.", param=request.prompt_param)
            return min(limits.default_output_tokens, room)
        if limits.max_output_tokens is not None and requested > limits.max_output_tokens:
            raise bad_request(f"max_tokens is {requested}; model {self.model!r} allows at most "
                              f"{limits.max_output_tokens} output tokens", param="max_tokens")
        if requested > room:
            pool = (f" (the decode engines' KV pool holds {limits.decode_pool_tokens} tokens)"
                    if limits.decode_pool_tokens is not None and limits.decode_pool_tokens < limits.context_length - 1
                    else "")
            raise context_length_exceeded(
                f"This model's maximum context length is {maximum} tokens{pool}. However, you requested "
                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the {_prompt_noun(request)}, {requested} in "
                "the completion). Please reduce the length of the messages or completion.", param="max_tokens")
        return requested

    # ── counting ────────────────────────────────────────────────────────────────────────────────────────────
    async def _count(self, request: ClientRequest, *, tenant: str, limit: int, dialects: frozenset[Dialect],
                     off_loop: bool) -> tuple[dict[Dialect, CountResult], PromptHead, bytes | None]:
        """Each dialect's count, the prompt's head as the engine tokenizes it (for the prefix hash), and its first
        token ids where cache-aware routing needs them."""
        prompt = request.prompt
        if isinstance(prompt, IdsPrompt):
            n = len(prompt.ids)
            route_ids = None
            if n <= limit:  # the length alone decides a refusal, before any id is looked at
                await _maybe_off_loop(self._check_ids, prompt.ids, large=off_loop)
                # Only checked ids become routing ids (array("I") of -1, 2**40 or "x" would raise: a 500).
                route_ids = await self._route_ids(prompt.ids, tenant, large=off_loop)
            return dict.fromkeys(dialects, CountResult(n, exact=True)), prompt.ids, route_ids
        if isinstance(prompt, TextPrompt):
            route_ids = await self._route_ids((prompt.text, True), tenant, large=off_loop)
            result = await self._count_text(prompt.text, tenant, special=True, limit=limit)
            return dict.fromkeys(dialects, result), (prompt.text, True), route_ids
        assert isinstance(prompt, ChatPrompt)
        counts: dict[Dialect, CountResult] = {}
        by_text: dict[tuple[str, str | None], CountResult] = {}
        head: PromptHead = []
        route_ids = None
        for dialect in sorted(dialects, key=lambda d: d.value):
            plan, text = await _maybe_off_loop(self._render, prompt, dialect, large=off_loop)
            if not head:
                head = (text, False)
                route_ids = await self._route_ids(head, tenant, large=off_loop)
            key = (text, plan.assistant_prefix)
            if key not in by_text:
                by_text[key] = await self._count_chat(text, plan.assistant_prefix, tenant, limit)
            counts[dialect] = by_text[key]
        return counts, head, route_ids

    def _render(self, prompt: ChatPrompt, dialect: Dialect) -> tuple[RenderPlan, str]:
        plan = prompt.plan(dialect, self.chat.content_format)
        return plan, self._render_plan(plan)

    def _render_plan(self, plan: RenderPlan) -> str:
        """serving_chat.py: _apply_jinja_template — on any failure SGLang retries once with the tools reshaped."""
        try:
            return self._render_once(plan, plan.tools)
        except RenderFailed:
            if plan.fallback_tools is None:
                raise bad_request("messages cannot be rendered with the model's chat template",
                                  param="messages") from None
        try:
            return self._render_once(plan, plan.fallback_tools)
        except RenderFailed as exc:
            raise bad_request(f"messages cannot be rendered with the model's chat template: {exc}",
                              param="messages") from exc

    def _render_once(self, plan: RenderPlan, tools: list[dict[str, Any]] | None) -> str:
        return self.template.render(plan.messages, tools=tools, documents=plan.documents, extra=plan.variables)

    async def _count_chat(self, text: str, prefix: str | None, tenant: str, limit: int) -> CountResult:
        rendered = await self._count_text(text, tenant, special=False, limit=limit)
        if not prefix or rendered.tokens > limit:
            return rendered
        # serving_chat.py: _append_assistant_prefix_to_prompt_ids — the prefix is encoded on its own with the
        # tokenizer's defaults and a leading BOS dropped.
        appended = await self._count_text(prefix, tenant, special=True, limit=limit - rendered.tokens)
        tokens = rendered.tokens + appended.tokens
        if self._bos_token_id is not None and appended.exact and await _maybe_off_loop(
                self._first_id, prefix, large=len(prefix) > 4096) == self._bos_token_id:
            tokens -= 1
        return CountResult(tokens, exact=appended.exact)

    async def _count_text(self, text: str, tenant: str, *, special: bool, limit: int) -> CountResult:
        try:
            return await self.counter.count_bounded(text, tenant=tenant, add_special_tokens=special, limit=limit)
        except UnencodableText as exc:
            raise bad_request(f"prompt cannot be tokenized: {exc}") from exc

    def _first_id(self, text: str) -> int | None:
        ids = self.tokenizer.tokenizer.encode_batch_fast([text], add_special_tokens=True)[0].ids
        return ids[0] if ids else None

    def _check_ids(self, ids: list[Any], *, param: str | None = None) -> None:
        vocab = self._vocab_size
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise bad_request(f"token ids must be integers in [0, {vocab}); got {token!r}", param=param)


def _prompt_noun(request: ClientRequest) -> str:
    return "messages" if isinstance(request.prompt, ChatPrompt) else "prompt"


async def _maybe_off_loop(function: Callable[..., T], *args: Any, large: bool) -> T:
    """Small work runs inline; large work in a thread, where the loop still runs at every GIL hand-over."""
    if not large:
        return function(*args)
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)
