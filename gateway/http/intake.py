"""A client request's way in, the same on every route that reads a body or says what is served: who asks (API key →
tenant: 401 before the body), whether it is throttled (429 before the body), and its body, capped and timed (413,
415, 408) — before anything in it is parsed. A route that skips this is a way around the tenant checks."""

from __future__ import annotations

import asyncio
import os
import re
from typing import TYPE_CHECKING

from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.http.body import BodyTooLarge, EncodedBody, RequestBody, read_body
from gateway.http.client_link import BodySource, Headers
from gateway.tenancy.errors import RateLimited
from gateway.tenancy.tenants import Tenant

if TYPE_CHECKING:
    from gateway.serving.gateway import Gateway

__all__ = ["CLOSE", "Headers", "Refused", "charge", "error_response", "identify", "receive_body", "request_id_of",
           "retry_after", "throttle"]

CLOSE: Headers = ((b"connection", b"close"),)


class Refused(Exception):
    """Answer `error` with `headers`: the request goes no further."""

    def __init__(self, error: GatewayError, headers: Headers) -> None:
        super().__init__(error.message)
        self.error = error
        self.headers = headers


_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")


def request_id_of(headers: Headers) -> bytes:
    """The id every answer carries as x-request-id: the client's own when it sent a sane one (bounded, no
    separators that could split a log line or a header), else a new one."""
    sent = next((value for name, value in headers if name == b"x-request-id"), None)
    return sent if sent is not None and _CLIENT_REQUEST_ID.fullmatch(sent) else os.urandom(16).hex().encode()


def error_response(error: GatewayError, headers: Headers = ()) -> Response:
    """The error as a starlette response (the generate routes write theirs to the ASGI `send` directly)."""
    return Response(error.json(), status_code=error.status, media_type="application/json",
                    headers={name.decode(): value.decode() for name, value in headers})


def retry_after(error: GatewayError) -> list[tuple[bytes, bytes]]:
    seconds = error.retry_after_s
    return [(b"retry-after", str(seconds).encode())] if seconds is not None else []


async def identify(gateway: Gateway, headers: Headers, client: tuple[str, int] | None) -> Tenant:
    try:
        return await gateway.fleet.tenants.identify(headers, client)
    except GatewayError as error:  # before the body is read: an unknown client costs nothing more
        raise Refused(error, retry_after(error) or ((b"www-authenticate", b"Bearer"),)) from None


def throttle(gateway: Gateway, tenant: Tenant) -> None:
    try:
        gateway.fleet.limiter.check(tenant)  # a throttled tenant's body is not even read
    except RateLimited as error:
        raise Refused(error, retry_after(error)) from None


async def receive_body(gateway: Gateway, source: BodySource, body: RequestBody, tenant: Tenant) -> None:
    """The body into `body`, charged to the tenant (one request, the bytes that came) before anything parses it,
    whether it is then answered, refused, too large, late or abandoned; ConnectionAbortedError when the client leaves
    first."""
    timeout_s = gateway.config.timeouts.client_body_s
    refusal: Exception | None = None
    try:
        if source.body_complete:  # all of it is in already: nothing to time (a timer per request otherwise)
            await read_body(source, body, gateway.config.max_body_bytes)
        else:
            async with asyncio.timeout(timeout_s):
                await read_body(source, body, gateway.config.max_body_bytes)
    except TimeoutError:
        refusal = Refused(GatewayError(408, f"the request body did not arrive within {timeout_s:g}s",
                                       code="request_timeout"), CLOSE)
    except (BodyTooLarge, EncodedBody) as error:
        refusal = Refused(error, CLOSE)
    except ConnectionAbortedError as gone:
        refusal = gone
    try:
        await charge(gateway, tenant, body.size)
    except Refused:
        if refusal is None:
            raise
    if refusal is not None:
        raise refusal


async def charge(gateway: Gateway, tenant: Tenant, body_bytes: int = 0) -> None:
    """One request of the tenant's, and its body's bytes; Refused (429) when a budget is empty."""
    try:
        await gateway.fleet.limiter.charge_request(tenant, body_bytes)
    except RateLimited as error:
        raise Refused(error, retry_after(error)) from None
