"""SGLang's `/v1/tokenize` and `/v1/detokenize` (and their unversioned aliases), answered by the gateway itself with
each model's own tokenizer — the one admission counts with, configured the same way (no truncation, no padding) — so
a client can count a prompt exactly as kvgate will count it before sending it.

Request shapes follow SGLang's serving_tokenize: `{"model", "prompt": str | [str], "add_special_tokens": true}` →
`{"tokens", "count", "max_model_len"}` (plus kvgate's `max_prompt_tokens`, the effective limit); `{"model",
"tokens": [int] | [[int]]}` → `{"text"}`. Long inputs are encoded off the event loop."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission.pipeline import resolve_model
from gateway.admission.requests import decode_json_object
from gateway.errors import GatewayError, bad_request

if TYPE_CHECKING:
    from gateway.runtime import Gateway, ServedModel

_OFF_LOOP_CHARS = 8192
_MAX_ITEMS = 1024
# Returning ids builds one Python int each, under the GIL: beyond this the event loop would stall (count with
# /generate instead: admission counts any size without building ids).
_MAX_CHARS = 2 * 2**20
_MAX_IDS = 2**21  # detokenize: ids checked and decoded per request


def _answer(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _error(error: GatewayError) -> Response:
    return Response(error.json(), status_code=error.status, media_type="application/json")


def _valid_ids(batches: list[Any], vocab: int) -> bool:
    return all(isinstance(b, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                           for t in b) for b in batches)


class TokenizeApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [Route(path, handler, methods=["POST"]) for path, handler in (
            ("/v1/tokenize", self.tokenize), ("/tokenize", self.tokenize),
            ("/v1/detokenize", self.detokenize), ("/detokenize", self.detokenize))]

    async def tokenize(self, request: Request) -> Response:
        try:
            data = decode_json_object(await self._body(request))
            model = self._model(data)
            prompt = data.get("prompt")
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not prompts or len(prompts) > _MAX_ITEMS \
                    or not all(isinstance(p, str) for p in prompts):
                raise bad_request(f"prompt must be a string or a list of at most {_MAX_ITEMS} strings",
                                  param="prompt")
            if sum(len(p) for p in prompts) > _MAX_CHARS:
                raise GatewayError(413, f"tokenize answers at most {_MAX_CHARS} characters of text",
                                   code="body_too_large", param="prompt")
            special = data.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise bad_request("add_special_tokens must be a boolean", param="add_special_tokens")
            ids = await self._encode(model, prompts, special)
        except GatewayError as error:
            return _error(error)
        limits = model.admission.limits
        tokens: Any = ids[0] if single else ids
        counts: Any = len(ids[0]) if single else [len(i) for i in ids]
        return _answer({"tokens": tokens, "count": counts, "max_model_len": limits.context_length,
                        "max_prompt_tokens": limits.prompt_tokens})

    async def detokenize(self, request: Request) -> Response:
        try:
            data = decode_json_object(await self._body(request))
            model = self._model(data)
            tokens = data.get("tokens")
            if not isinstance(tokens, list):
                raise bad_request("tokens must be a list of token ids, or a list of such lists", param="tokens")
            single = not tokens or not isinstance(tokens[0], list)
            batches = [tokens] if single else tokens
            total = sum(len(b) if isinstance(b, list) else 1 for b in batches)  # lengths only: cheap
            if len(batches) > _MAX_ITEMS or total > _MAX_IDS:
                raise GatewayError(413, f"detokenize answers at most {_MAX_IDS} token ids", code="body_too_large",
                                   param="tokens")
            vocab = model.admission.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
            valid = await asyncio.get_running_loop().run_in_executor(None, _valid_ids, batches, vocab)
            if not valid:
                raise bad_request(f"tokens must be a list of token ids in [0, {vocab}), or a list of such lists",
                                  param="tokens")
        except GatewayError as error:
            return _error(error)
        decode = model.admission.tokenizer.tokenizer.decode_batch
        texts = await asyncio.get_running_loop().run_in_executor(None, lambda: decode(batches,
                                                                                     skip_special_tokens=False))
        return _answer({"text": texts[0] if single else texts})

    async def _body(self, request: Request) -> bytes:
        body = await request.body()
        if len(body) > self.gateway.config.max_body_bytes:
            raise GatewayError(413, "request body exceeds the gateway's limit", code="body_too_large")
        return body

    def _model(self, data: dict[str, Any]) -> ServedModel:
        name = data.get("model")
        if name is not None and not isinstance(name, str):
            raise bad_request("model must be a string", param="model")
        # The same lookup as admission's; a model the gate refused still has its tokenizer, so it answers here too.
        return resolve_model(name, self.gateway.models, lambda _: None)

    @staticmethod
    async def _encode(model: ServedModel, prompts: list[str], special: bool) -> list[list[int]]:
        encode = model.admission.tokenizer.tokenizer.encode_batch_fast

        def run() -> list[list[int]]:
            return [list(e.ids) for e in encode(prompts, add_special_tokens=special)]

        if sum(len(p) for p in prompts) <= _OFF_LOOP_CHARS:
            return run()
        return await asyncio.get_running_loop().run_in_executor(None, run)
