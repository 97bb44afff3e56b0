"""SGLang's `/v1/tokenize` and `/v1/detokenize` (and their unversioned aliases), answered by the gateway itself with
each model's own tokenizer — the one admission counts with, configured the same way (no truncation, no padding) — so
a client can count a prompt exactly as kvgate will count it before sending it.

Request shapes follow SGLang's serving_tokenize: `{"model", "prompt": str | [str], "add_special_tokens": true}` →
`{"tokens", "count", "max_model_len"}` (plus kvgate's `max_prompt_tokens`, the effective limit); `{"model",
"tokens": [int] | [[int]]}` → `{"text"}`.

They are served like the generate routes up to the engine: the same API key and tenant throttling before the body
is read, the same body limit and timeout, and a large body (over 64 KiB) is parsed, tokenized and its answer
serialised in an admission worker process, so no body, however built, holds the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission.admit import Admission
from gateway.admission.pipeline import resolve_model
from gateway.admission.tokenize import Kind, answer
from gateway.errors import GatewayError
from gateway.http.body import RequestBody
from gateway.http.client_link import AsgiBody
from gateway.http.intake import CLOSE, Refused, error_response, identify, receive_body, throttle

if TYPE_CHECKING:
    from gateway.serving.gateway import Gateway
    from gateway.tenancy.tenants import Tenant

class TokenizeApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        endpoints: tuple[tuple[str, Kind], ...] = (("/v1/tokenize", "tokenize"), ("/tokenize", "tokenize"),
                                                   ("/v1/detokenize", "detokenize"), ("/detokenize", "detokenize"))
        return [Route(path, self._endpoint(kind), methods=["POST"]) for path, kind in endpoints]

    def _endpoint(self, kind: Kind) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            return await self._serve(kind, request)
        return endpoint

    async def _serve(self, kind: Kind, request: Request) -> Response:
        gateway = self.gateway
        if gateway.shutting_down:
            return error_response(GatewayError(503, "the gateway is shutting down", code="shutting_down"),
                          [*CLOSE, (b"retry-after", b"1")])
        try:
            tenant = await identify(gateway, request.headers.raw, request.client)
            throttle(gateway, tenant)
            with RequestBody() as body:
                await receive_body(gateway, AsgiBody(request.scope, request.receive), body, tenant)
                payload = await self._answer(kind, body, tenant)
        except Refused as refused:
            return error_response(refused.error, refused.headers)
        except GatewayError as error:
            return error_response(error)
        except ConnectionAbortedError:
            return Response(status_code=499)  # nobody is listening; nothing is logged as an error
        return Response(payload, media_type="application/json")

    async def _answer(self, kind: Kind, body: RequestBody, tenant: Tenant) -> bytes:
        raw = body.in_memory
        if raw is None:  # large: parsed, tokenized and serialised in an admission worker process
            assert body.path is not None  # a body is in memory or spooled to its file
            limits = {m.name: m.admission.limits for m in self.gateway.models.values()}
            return await self.gateway.admission_workers.tokenize(kind, body.path, tenant=tenant.name,
                                                                 line=tenant.admission_line, limits=limits)
        # The same lookup as admission's; a model the gate refused still has its tokenizer, so it answers here too.
        models = self.gateway.models

        def find(name: str | None) -> Admission:
            return resolve_model(name, models, lambda _: None).admission

        return await asyncio.get_running_loop().run_in_executor(None, answer, kind, raw, find)
