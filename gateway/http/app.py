"""The HTTP app: routes, lifespan, and the small JSON endpoints (the generate endpoints: gateway.http.generate)."""

from __future__ import annotations

import time
import traceback

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from gateway.admission.requests import reject_unknown_model
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.http.admin import AdminApi
from gateway.http.generate import GenerateEndpoint
from gateway.http.intake import Refused, charge, error_response, identify, request_id_of, retry_after, throttle
from gateway.http.tokenize import TokenizeApi
from gateway.serving.canary import CanaryProber
from gateway.serving.gateway import GateRefused, Gateway
from gateway.serving.models import ServedModel


def _json(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


class GatewayApp:
    """The ASGI app: the three generate routes go straight to their endpoints, everything else to Starlette
    (Starlette's routing and middleware cost ~5% of the gateway's CPU per request on the hot path, and add nothing
    there); the lifespan starts and stops the gateway."""

    def __init__(self, gateway: Gateway, app: Starlette, endpoints: dict[str, GenerateEndpoint]) -> None:
        self.gateway = gateway
        self.app = app
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is not None:
            await endpoint(scope, receive, send)
        elif scope["type"] == "http":
            await self.app(scope, receive, _with_request_id(scope, send))
        else:
            await self.app(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            await self.gateway.start()
        except GateRefused:
            # The gateway working as designed: `serve` prints the refusal; no traceback, every session closed.
            await self.gateway.stop()
            await send({"type": "lifespan.startup.failed", "message": ""})
            return
        except BaseException:
            await self.gateway.stop()
            await send({"type": "lifespan.startup.failed", "message": traceback.format_exc()})
            return
        prober = CanaryProber(self.gateway, self)
        prober.start()
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await prober.stop()
        await self.gateway.stop()
        await send({"type": "lifespan.shutdown.complete"})


def _with_request_id(scope: Scope, send: Send) -> Send:
    """Every answer carries x-request-id (the generate endpoints stamp their own)."""
    request_id = request_id_of(scope["headers"])

    async def stamped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
        await send(message)

    return stamped


def create_app(config: GatewayConfig, gateway: Gateway | None = None, *,
               config_path: str | None = None) -> GatewayApp:
    gateway = gateway or Gateway(config, config_path=config_path)
    started = int(time.time())

    def entry(model: ServedModel) -> dict[str, object]:
        return {"id": model.name, "object": "model", "created": started, "owned_by": "kvgate",
                "max_model_len": model.config.context_length,
                "max_prompt_tokens": model.admission.limits.prompt_tokens, "available": model.unavailable is None}

    async def refused(request: Request) -> Response | None:
        """The models and their limits are for clients with a key, where one is required, and cost a request of
        the tenant's (as the generate routes do)."""
        try:
            tenant = await identify(gateway, request.headers.raw, request.client)
            throttle(gateway, tenant)
            await charge(gateway, tenant)
        except Refused as refused:
            return error_response(refused.error, refused.headers)
        except GatewayError as error:  # the shared state is down and the gateway fails closed
            return error_response(error, retry_after(error))
        return None

    async def list_models(request: Request) -> Response:
        if (answer := await refused(request)) is not None:
            return answer
        return _json({"object": "list", "data": [entry(model) for model in gateway.models.values()]})

    async def model(request: Request) -> Response:
        if (answer := await refused(request)) is not None:
            return answer
        served = gateway.models.get(request.path_params["model_id"])
        if served is None:
            return error_response(reject_unknown_model(request.path_params["model_id"], list(gateway.models)))
        return _json(entry(served))

    async def healthz(_: Request) -> Response:
        return _json({"status": "alive"})

    async def readyz(_: Request) -> Response:
        ready, problems = gateway.ready()
        if ready:
            return _json({"status": "ready"})
        return _json({"status": "not ready", "models": problems}, status=503)

    async def metrics(_: Request) -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    endpoints = {route: GenerateEndpoint(route, gateway)
                 for route in ("/v1/chat/completions", "/v1/completions", "/generate")}
    routes = [
        *(Route(path, endpoint) for path, endpoint in endpoints.items()),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *AdminApi(gateway).routes(),
        *TokenizeApi(gateway).routes(),
    ]
    return GatewayApp(gateway, Starlette(routes=routes), endpoints)
