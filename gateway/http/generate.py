"""The generate endpoints: read the body (capped, timed), admit, dispatch, relay.

Served from a `ClientLink`: straight from kvgate's HTTP protocol (gateway.http.edge), or as an ASGI app (the
canary's in-process transport and what the edge leaves to ASGI). Not a Starlette request/response endpoint because
the gateway must notice a client disconnect in every phase, including the wait before the first byte of a
non-streaming response, where Starlette listens for nothing: the link hands a disconnect over to
`PDExchange.disconnect()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import Receive, Scope, Send

from gateway.admission.requests import Route
from gateway.errors import GatewayError, shutting_down
from gateway.http.body import RequestBody
from gateway.http.client_link import AsgiLink, ClientLink
from gateway.http.intake import CLOSE, Headers, Refused, identify, receive_body, request_id_of, retry_after, throttle
from gateway.http.relay import ClientResponse, relay, send_error
from gateway.integrity.probe import is_probe
from gateway.pd.exchange import PDExchange
from gateway.telemetry.record import RequestRecord
from gateway.tenancy.errors import StateDown
from gateway.tenancy.tenants import CANARY

if TYPE_CHECKING:
    from gateway.serving.gateway import Gateway



class GenerateEndpoint:
    """`POST /generate`, `/v1/completions` or `/v1/chat/completions`."""

    def __init__(self, route: Route, gateway: Gateway) -> None:
        self.route = route
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.serve(AsgiLink(scope, receive, send))

    async def serve(self, link: ClientLink) -> None:
        request_id = request_id_of(link.headers)
        record = RequestRecord(self.route, request_id.decode(), probe=is_probe(link.headers))
        if not record.probe:
            self.gateway.tracing.start_request(record, link.headers)
        try:
            await self._serve(link, ClientResponse(link, request_id, record), record)
        finally:
            self.gateway.observe_request(record)

    async def _serve(self, link: ClientLink, response: ClientResponse, record: RequestRecord) -> None:
        if link.method != "POST":
            await send_error(response, GatewayError(405, f"{self.route} accepts POST only"))
            return
        if self.gateway.shutting_down:
            await self._refuse(response, record, shutting_down(), [*CLOSE, (b"retry-after", b"1")])
            return
        if self.gateway.fleet.closed:
            await self._refuse(response, record, StateDown(), [(b"retry-after", b"1")])
            return
        with RequestBody() as body:
            exchange = await self._admit(link, response, body, record)
        if exchange is None:
            return
        record.exchange = exchange
        link.on_disconnect(exchange.disconnect)
        try:
            await relay(exchange, response)
        except BaseException:
            exchange.disconnect()  # the answer cannot go on: nobody would read the exchange's events again
            raise
        finally:
            link.on_disconnect(None)

    async def _admit(self, link: ClientLink, response: ClientResponse, body: RequestBody,
                     record: RequestRecord) -> PDExchange | None:
        """Who asks and its body (the way in), then the serving flow: admitted and dispatched, or refused (the
        error answered here, None returned)."""
        gateway = self.gateway
        try:
            tenant = CANARY if record.probe else await identify(gateway, link.headers, link.client)
            record.tenant = tenant.name
            throttle(gateway, tenant)
            await receive_body(gateway, link, body, tenant)
            fleet = gateway.fleet
            return await gateway.flow.run(self.route, body, tenant, fleet.limiter, fleet.salts, link.headers,
                                          record, sample=not record.probe)  # the canary is not a tenant
        except Refused as refused:
            await self._refuse(response, record, refused.error, refused.headers)
        except GatewayError as error:
            await self._refuse(response, record, error, retry_after(error))
        except ConnectionAbortedError:
            pass
        return None

    @staticmethod
    async def _refuse(response: ClientResponse, record: RequestRecord, error: GatewayError,
                      headers: Headers = ()) -> None:
        """Answer an error before any engine saw the request."""
        record.refused = error
        await send_error(response, error, headers)


