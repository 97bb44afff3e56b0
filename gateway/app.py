"""The HTTP app: routes, lifespan, and the small JSON endpoints. The generate endpoints live in gateway.proxy."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import GatewayConfig
from gateway.proxy import GenerateEndpoint
from gateway.runtime import Gateway


def _json(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


class GenerateFastPath:
    """Sends the three generate routes straight to their endpoints, everything else to Starlette: Starlette's
    routing and middleware cost ~5% of the gateway's CPU per request on the hot path, and add nothing there."""

    def __init__(self, app: Starlette, endpoints: dict[str, GenerateEndpoint]) -> None:
        self.app = app
        self.endpoints = endpoints
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
        else:
            await endpoint(scope, receive, send)


def create_app(config: GatewayConfig, gateway: Gateway | None = None) -> ASGIApp:
    gateway = gateway or Gateway(config)
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def list_models(_: Request) -> Response:
        data = []
        for model in gateway.models.values():
            limits = model.admission.limits
            data.append({"id": model.name, "object": "model", "created": started, "owned_by": "kvgate",
                         "max_model_len": model.config.context_length,
                         "max_prompt_tokens": limits.prompt_tokens,
                         "available": model.unavailable is None})
        return _json({"object": "list", "data": data})

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
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    return GenerateFastPath(app, endpoints)
