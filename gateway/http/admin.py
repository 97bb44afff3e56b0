"""The admin API: workers (list, add, drain, remove), configuration reload, the fleet-wide kill switch and aborts by
request id, behind a bearer token.

The token is read from the environment variable that `admin.token_env` names, at each request (so it can be rotated
by restarting nothing but the secret's mount); without one the API answers 403. Every answer carries x-request-id
(added by the app, as on every route)."""

from __future__ import annotations

import hmac
import os
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.config import ConfigError, DecodeWorkerConfig, PrefillWorkerConfig
from gateway.errors import GatewayError
from gateway.http.intake import error_response
from gateway.serving.reload import reload
from routing.membership import Member, WorkerExists, WorkerRefused
from routing.state import StateUnavailable
from routing.workers import WorkerSpec

if TYPE_CHECKING:
    from gateway.serving.gateway import Gateway


def _answer(status: int, payload: Any) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")  # + x-request-id


def _error(status: int, message: str, code: str) -> Response:
    return error_response(GatewayError(status, message, code=code))


class AdminApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def routes(self) -> list[Route]:
        return [Route("/admin/workers", self._guarded(self.list_workers), methods=["GET"]),
                Route("/admin/workers", self._guarded(self.add_worker), methods=["POST"]),
                Route("/admin/workers/{id}/drain", self._guarded(self.drain_worker), methods=["POST"]),
                Route("/admin/workers/{id}", self._guarded(self.remove_worker), methods=["DELETE"]),
                Route("/admin/reload", self._guarded(self.reload), methods=["POST"]),
                Route("/admin/models/{name:path}/disable", self._guarded(self.disable_model), methods=["POST"]),
                Route("/admin/models/{name:path}/enable", self._guarded(self.enable_model), methods=["POST"]),
                Route("/admin/requests/{id:path}/abort", self._guarded(self.abort_request), methods=["POST"])]

    def _guarded(self, handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            env = self.gateway.config.admin.token_env
            token = os.environ.get(env, "")
            if not token:
                return _error(403, f"the admin API is off: set the token in ${env}", "admin_disabled")
            sent = request.headers.get("authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong admin bearer token", "unauthorized")
            if self.gateway.membership is None:
                return _error(503, "the gateway is starting", "starting")
            result: Response = await handler(request)
            return result
        return endpoint

    async def list_workers(self, request: Request) -> Response:

        return _answer(200, {"workers": [m.describe() for m in self.gateway.membership.members()]})

    async def add_worker(self, request: Request) -> Response:
        membership = self.gateway.membership
        try:
            body = orjson.loads(await request.body())
            model, _role, spec = _worker_spec(body)
        except (orjson.JSONDecodeError, ValueError, ValidationError) as exc:
            return _error(400, f"expected {{model, role, url, bootstrap_port}}: {exc}", "bad_request")
        if model not in self.gateway.models:
            return _error(404, f"no model named {model!r}", "model_not_found")
        try:
            member = await membership.add(model, spec)
        except WorkerExists as exc:
            return _error(409, str(exc), "worker_exists")
        except WorkerRefused as exc:
            return _error(422, str(exc), "refused_by_gate")
        return _answer(201, member.describe())

    async def drain_worker(self, request: Request) -> Response:
        member = self._member(request)
        if member is None:
            return _error(404, f"no worker {request.path_params['id']!r}", "worker_not_found")

        self.gateway.membership.drain(member)
        return _answer(200, member.describe())

    async def remove_worker(self, request: Request) -> Response:
        member = self._member(request)
        if member is None:
            return _error(404, f"no worker {request.path_params['id']!r}", "worker_not_found")

        self.gateway.membership.remove(member)
        return _answer(200, {**member.describe(), "removed": True})

    async def reload(self, request: Request) -> Response:
        try:
            changes = await reload(self.gateway)
        except ConfigError as exc:
            return _error(400, f"reload refused, running configuration kept: {exc}", "reload_refused")
        return _answer(200, {"reloaded": True, "changes": changes})

    async def disable_model(self, request: Request) -> Response:
        """The kill switch: every replica answers the model's new requests with 503 within a sync interval (at once
        when pub/sub delivers); `?cancel_inflight=true` also cancels its requests in flight, on both halves."""
        cancel = request.query_params.get("cancel_inflight", "false").lower() in ("1", "true", "yes")
        return await self._switch(request, disabled=True, cancel=cancel)

    async def enable_model(self, request: Request) -> Response:
        return await self._switch(request, disabled=False, cancel=False)

    async def _switch(self, request: Request, *, disabled: bool, cancel: bool) -> Response:
        name = request.path_params["name"]
        if name not in self.gateway.models:
            return _error(404, f"no model named {name!r}", "model_not_found")
        fleet = self.gateway.fleet
        try:
            await fleet.state.set_disabled(name, disabled, cancel_inflight=cancel)
        except StateUnavailable as exc:
            return _error(503, f"the shared state did not take the change: {exc}", "state_unavailable")
        await fleet.sync_now()  # this replica follows at once; the others on their next sync
        return _answer(200, {"model": name, "disabled": disabled, "cancel_inflight": cancel})

    async def abort_request(self, request: Request) -> Response:
        """Cancel a request in flight by the x-request-id the gateway returned, on whichever replica owns it: every
        replica is asked at once and the answer waits (a quarter of a second at most) for theirs."""
        request_id = request.path_params["id"]
        fleet = self.gateway.fleet
        local = self.gateway.abort_local(request_id)
        try:  # every holder of the id, here and elsewhere (a client may reuse ids)
            owners = [r for r in await fleet.state.request_abort(request_id) if r != fleet.replica]
        except StateUnavailable as exc:
            if local:
                return _answer(200, {"request_id": request_id, "aborted_here": local, "replicas": []})
            return _error(503, f"the shared state could not be asked: {exc}", "state_unavailable")
        if not local and not owners:
            return _error(404, f"no request {request_id!r} in flight on any live replica", "request_not_found")
        return _answer(200 if not owners else 202, {"request_id": request_id, "aborted_here": local,
                                                    "replicas": owners})

    def _member(self, request: Request) -> Member | None:

        return self.gateway.membership.find(request.path_params["id"])


def _worker_spec(body: Any) -> tuple[str, str, WorkerSpec]:
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise ValueError("model must be a string")
    role = body.get("role")
    if role == "prefill":
        prefill = PrefillWorkerConfig.model_validate({k: body[k] for k in ("url", "bootstrap_port") if k in body})
        return body["model"], role, WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port, origin="admin")
    if role == "decode":
        decode = DecodeWorkerConfig.model_validate({"url": body.get("url")})
        return body["model"], role, WorkerSpec(decode.url, "decode", origin="admin")
    raise ValueError("role must be prefill or decode")
