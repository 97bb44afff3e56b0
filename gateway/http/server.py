"""The HTTP server kvgate runs on: uvicorn with httptools, plus the limits a public edge needs.

The generate routes are served straight from this protocol (`gateway.http.edge`), past every guard below; the rest
of the API goes through ASGI and Starlette.

uvicorn caps concurrent connections (`limit_concurrency`, beyond it 503) but not the size, number or arrival time of
request headers; `GuardedHttpToolsProtocol` adds those, answering 431 before a header flood is buffered and 408 to a
connection that opens and never finishes its request head (else a few idle sockets would hold every connection slot).
No one client takes the connection cap for itself either: each client address, and each API key once a request head
names one, holds at most its share; a connection beyond it is answered 503 at once and closed.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import signal
import socket
import sys
import traceback
from collections import Counter
from collections.abc import Mapping
from types import FrameType
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.http.app import GatewayApp, create_app
from gateway.http.edge import EdgeCycle, EdgeEndpoint
from gateway.serving.gateway import Gateway
from gateway.serving.reload import reload_logged
from gateway.tenancy.tenants import bearer_key_of

YOUNG_COLLECTION_THRESHOLD = 50_000  # container allocations between young collections (Python's default: 700)


def settle_collector() -> None:
    """The cyclic collector set for serving, once startup is done.

    What startup built (tokenizers, templates, indexes, the framework's own modules) lives as long as the process:
    frozen out of the collector, whose full runs would otherwise walk it every few seconds under load (~60 ms a run
    on a 2-core machine). Requests are freed by reference counting (the collector found nothing in 2,500 proxied
    requests), but at c=64 the requests in flight hold ~10,000 young containers that come and go, so at Python's
    default threshold a young collection walked them every ~10 requests for nothing: ~30 µs of CPU per request. A
    rare collection still catches whatever cycle a failure path leaves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a cap on a request's header bytes (request line included) and count, and
    on open connections (uvicorn's own `limit_concurrency` answers a bare 503; clients need Retry-After)."""

    max_header_bytes = 64 * 1024
    max_headers = 100
    head_timeout_s = 10.0
    # A body still arriving this long after its head closes the connection, whether or not the app reads it (an
    # answer given before the body was read — 401, 404, 429 — would otherwise keep a slow body's socket for good).
    # The app's own body timer (`timeouts.client_body_s`) answers 408 a second sooner where it reads the body.
    body_timeout_s = 31.0
    max_connections = 1024
    client_share = 256  # connections one client address may hold
    key_share = 256  # connections one API key may hold, from any number of addresses
    # Per server (uvicorn_config makes a subclass per configuration): open connections per address and per key.
    by_address: ClassVar[Counter[str]] = Counter()
    by_key: ClassVar[Counter[bytes]] = Counter()
    # Served from the protocol itself (a POST over HTTP/1.1 to one of these exact paths, no query, no escapes).
    edge_routes: ClassVar[Mapping[bytes, EdgeEndpoint]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._header_bytes = 0
        self._header_count = 0
        self._head_too_large = False
        self._over_capacity = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._two_keys = False
        self._bad_upgrade = False
        self._address: str | None = None
        self._key: bytes | None = None  # a digest of the API key its last request named
        self._request_key: bytes | None = None
        self._running: Any = None  # the cycle whose task was started last (an EdgeCycle or uvicorn's own)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        if address is not None:
            self._address = address
            self.by_address[address] += 1
            if self.by_address[address] > self.client_share:  # one client is not the whole internet
                self._answer(503, "Service Unavailable", "too_many_connections",
                             f"this client holds {self.client_share} open connections, its share of the gateway's",
                             retry_after_s=1)
                return
        # Judged when the connection opens: in a burst, the connections that came first are served.
        self._over_capacity = len(self.connections) > self.max_connections
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        if self._address is not None:
            _forget(self.by_address, self._address)
            self._address = None
        if self._key is not None:
            _forget(self.by_key, self._key)
            self._key = None
        super().connection_lost(exc)
        # uvicorn tells only the newest cycle, which is not the one running when a request is pipelined behind it:
        # unheard, the running answer would go on to a closed transport (and fail there), its exchange running on
        # with nobody reading its events until decode's read paused for good (total_s).
        running = self._running
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True
            running.message_event.set()
        for cycle in (running,) if running is self.cycle else (running, self.cycle):
            if isinstance(cycle, EdgeCycle):
                cycle.connection_lost()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._header_count = 0
        self._in_head = True
        self._head_too_large = False
        self._request_key = None
        self._two_keys = False
        if self._head_timer is None:
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            self._head_too_large = True
            raise ValueError("too many headers")
        if len(name) == 13 and name.lower() == b"authorization":  # a digest: the key itself is not kept here
            if self._request_key is not None:  # which one would count? The tenant takes the first: refused
                self._two_keys = True
                raise ValueError("two authorization headers")
            self._request_key = hashlib.blake2b(bearer_key_of(value), digest_size=16).digest()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        self._body_timer = asyncio.get_running_loop().call_later(self.body_timeout_s, self._body_timed_out)
        if self._request_key != self._key:  # the connection now counts for the key its request names
            if self._key is not None:
                _forget(self.by_key, self._key)
            self._key = self._request_key
            if self._key is not None:
                self.by_key[self._key] += 1
        if self._key is not None and self.by_key[self._key] > self.key_share:
            self._over_capacity = True
            raise ConnectionRefusedError("over the key's share")  # stops the parser: answered in _feed
        if self._over_capacity or len(self.tasks) >= self.max_connections:
            self._over_capacity = True
            raise ConnectionRefusedError("over max_connections")  # stops the parser: answered in _feed
        if self.parser.should_upgrade() and not self._should_upgrade() and _has_body(self.headers):
            # httptools stops at an upgrade and is not resumed: the body would be lost (answered "empty"). A GET
            # asking for h2c (curl --http2) has none and is served as HTTP/1.1.
            self._bad_upgrade = True
            raise ValueError("a body behind an upgrade kvgate does not make")  # stops the parser: answered in _feed
        endpoint = self.edge_routes.get(self.url)
        if endpoint is None or self.parser.get_method() != b"POST" or self.parser.get_http_version() != "1.1" \
                or self.parser.should_upgrade():
            super().on_headers_complete()
            if self.parser.should_upgrade() and not self._should_upgrade() and self.cycle is not None:
                # httptools is not resumed after it: whatever follows on this connection would go unread and
                # unanswered, so the answer closes it.
                self.cycle.keep_alive = False
            return
        self._serve_at_edge(endpoint)

    def _serve_at_edge(self, endpoint: EdgeEndpoint) -> None:
        """What uvicorn's `on_headers_complete` does for an ASGI request, with an `EdgeCycle` in its place."""
        existing = self.cycle
        self.cycle = cycle = EdgeCycle(  # type: ignore[assignment]  # the protocol uses the attributes they share
            endpoint, transport=self.transport, flow=self.flow, headers=self.headers, client=self.client,
            keep_alive=self.parser.should_keep_alive(), expect_100_continue=self.expect_100_continue,
            default_headers=self.server_state.default_headers, on_response=self.on_response_complete)
        if existing is None or existing.response_complete:
            self._start_asgi_task(cycle, self.app)
        else:  # pipelined: it waits for the answer before it, as uvicorn's own cycles do
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))  # type: ignore[arg-type]

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_message_complete(self) -> None:
        self._disarm_body_timer()
        super().on_message_complete()

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm_head_timer()  # between requests uvicorn's own keep-alive timeout applies

    def _arm_head_timer(self) -> None:
        self._head_timer = asyncio.get_running_loop().call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._answer(408, "Request Timeout", "request_timeout",
                         f"the request head did not arrive within {self.head_timeout_s:g}s")

    def data_received(self, data: bytes) -> None:
        if not self._in_head:
            self._feed(data)
            return
        # Feed at most what the header budget still allows: httptools buffers a header until it is complete.
        room = self.max_header_bytes - self._header_bytes
        head, rest = data[:room], data[room:]
        self._header_bytes += len(head)
        self._feed(head)
        if rest and not self.transport.is_closing():
            if self._in_head:
                self._reject()
            else:
                self._feed(rest)

    def _feed(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._over_capacity and self._key is not None and self.by_key[self._key] > self.key_share:
                self._answer(503, "Service Unavailable", "too_many_connections",
                             f"this API key holds {self.key_share} open connections, its share of the gateway's",
                             retry_after_s=1)
            elif self._over_capacity:
                self._answer(503, "Service Unavailable", "overloaded",
                             f"the gateway is at its limit of {self.max_connections} open connections",
                             retry_after_s=1)
            elif self._head_too_large:
                self._reject()
            elif self._two_keys:
                self._answer(400, "Bad Request", "invalid_request", "a request carries one authorization header")
            elif self._bad_upgrade:
                self._answer(400, "Bad Request", "upgrade_not_supported",
                             "kvgate does not upgrade connections: send the request without an Upgrade header")
            else:  # uvicorn's own 400 is plain text without an x-request-id
                self._answer(400, "Bad Request", "invalid_request", "invalid HTTP request")

    def _reject(self) -> None:
        self._answer(431, "Request Header Fields Too Large", "headers_too_large",
                     f"request headers exceed the gateway's limits ({self.max_headers} headers, "
                     f"{self.max_header_bytes} bytes)")

    def _answer(self, status: int, reason: str, code: str, message: str, *, retry_after_s: int | None = None) -> None:
        """An error written straight to the socket (no request reached the app), then the connection is closed. It
        carries an x-request-id like every other answer (a new one: the head, and any id in it, is unread)."""
        body = GatewayError(status, message, code=code).json()
        retry = b"retry-after: %d\r\n" % retry_after_s if retry_after_s is not None else b""
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"x-request-id: %s\r\n%scontent-length: %d\r\n\r\n%s"
                             % (status, reason.encode(), os.urandom(16).hex().encode(), retry, len(body), body))
        self.transport.close()


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    return any((name == b"content-length" and value.strip() not in (b"", b"0")) or name == b"transfer-encoding"
               for name, value in headers)


def _forget(counts: Counter[Any], key: Any) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


def uvicorn_config(app: GatewayApp, config: GatewayConfig, *, log_level: str, loop: str = "uvloop") -> uvicorn.Config:
    protocol = type("GatewayHttpProtocol", (GuardedHttpToolsProtocol,),
                    {"edge_routes": {path.encode(): endpoint for path, endpoint in app.endpoints.items()},
                     "max_header_bytes": config.max_header_bytes, "max_headers": config.max_headers,
                     "head_timeout_s": config.timeouts.client_head_s, "max_connections": config.max_connections,
                     "body_timeout_s": config.timeouts.client_body_s + 1,
                     "client_share": config.connections_per_client, "key_share": config.connections_per_key,
                     "by_address": Counter(), "by_key": Counter()})
    # log_config=None: uvicorn's loggers propagate to the root handler kvgate set up (text or JSON lines); the
    # access log is kvgate's own (gateway.telemetry.observe), with the request's model, workers and outcome.
    return uvicorn.Config(app, host=config.listen.host, port=config.listen.port, log_level=log_level,
                          log_config=None, access_log=False, loop=loop, http=protocol, lifespan="on",
                          timeout_graceful_shutdown=5,
                          # A client's X-Forwarded-For must not choose who it is (an anonymous tenant is salted by
                          # its address): uvicorn trusts the header from loopback by default.
                          proxy_headers=False)


class GracefulServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT the gateway drains before uvicorn stops: /readyz answers 503 and new requests get
    503 at once (the listener stays open so load balancers see it), requests in flight get `shutdown.grace_s` to
    finish, the rest are cancelled on both halves; then uvicorn shuts down as usual. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = loop = asyncio.get_running_loop()
        try:  # SIGHUP re-reads the configuration file (main thread only)
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload_logged(self.gateway)))
        except (ValueError, RuntimeError, NotImplementedError):
            pass
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        settle_collector()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if self.gateway.shutting_down or loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        self.gateway.begin_shutdown()
        loop.call_soon_threadsafe(self._start_draining)

    def _start_draining(self) -> None:
        self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.gateway.drain(self.gateway.config.shutdown.grace_s)
        finally:
            self.should_exit = True


def serve_one(config: GatewayConfig, *, log_level: str, config_path: str | None,
               sock: socket.socket | None = None) -> int:
    try:
        app = create_app(config, config_path=config_path)
    except Exception:  # a model that cannot be built (its tokenizer, its template): not serving, as a refusal is
        traceback.print_exc()
        return 3
    server = GracefulServer(uvicorn_config(app, config, log_level=log_level), app.gateway)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    except SystemExit:  # uvicorn's way of reporting a failed startup
        pass
    if app.gateway.refusal is not None:
        print(f"kvgate: not serving.\n{app.gateway.refusal}", file=sys.stderr, flush=True)
    return 0 if server.started else 3


