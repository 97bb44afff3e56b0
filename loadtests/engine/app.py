"""Wires the endpoints onto the main HTTP server and, on a prefill, the bootstrap server."""

from __future__ import annotations

import asyncio
import sys

import orjson

from .api import GenerationAPI
from .emu import EmuAPI
from .engine import Engine
from .httpcore import TEXT, Handler, HttpServer, Request
from .info import InfoAPI
from .kvlink import UPGRADE_TOKEN, PrefillChannel


def _log_error(req: Request, e: Exception) -> None:
    print(f"kvgate-engine: error handling {req.method} {req.path}: {e!r}", file=sys.stderr, flush=True)


def main_server(engine: Engine) -> HttpServer:
    gen, info, emu = GenerationAPI(engine), InfoAPI(engine), EmuAPI(engine)
    routes: dict[tuple[str, str], Handler] = {
        ("POST", "/generate"): gen.generate, ("PUT", "/generate"): gen.generate,
        ("POST", "/v1/chat/completions"): gen.chat, ("POST", "/v1/completions"): gen.completions,
        ("GET", "/health"): info.health, ("GET", "/health_generate"): info.health,
        ("GET", "/server_info"): info.server_info, ("GET", "/get_server_info"): info.server_info,
        ("GET", "/model_info"): info.model_info, ("GET", "/get_model_info"): info.model_info,
        ("GET", "/v1/models"): info.models, ("GET", "/get_load"): info.get_load, ("GET", "/v1/loads"): info.loads,
        ("POST", "/flush_cache"): info.flush_cache, ("GET", "/flush_cache"): info.flush_cache,
        ("POST", "/abort_request"): info.abort_request,
        ("GET", "/emu/requests"): emu.requests, ("GET", "/emu/faults"): emu.get_faults,
        ("POST", "/emu/faults"): emu.add_faults, ("DELETE", "/emu/faults"): emu.clear_faults,
        ("POST", "/emu/reset"): emu.reset, ("GET", "/emu/state"): emu.state, ("GET", "/emu/cache"): emu.cache,
        ("GET", "/emu/kv_events"): emu.get_kv_events, ("POST", "/emu/kv_events"): emu.kv_events,
    }
    if engine.cfg.enable_metrics:
        routes[("GET", "/metrics")] = info.metrics
    return HttpServer(routes, on_error=_log_error)


def bootstrap_server(engine: Engine) -> HttpServer:
    """CommonKVBootstrapServer's routes, plus the upgrade that opens a decode's KV channel."""
    cfg = engine.cfg

    async def get_route(req: Request) -> None:
        if req.query.get("engine_rank", "-1") == "-1":
            body = {"prefill_attn_tp_size": 1, "prefill_dp_size": 1, "prefill_pp_size": 1,
                    "prefill_page_size": cfg.page_size}
        else:
            body = {"rank_ip": cfg.host, "rank_port": cfg.bootstrap_port}
        req.respond(200, orjson.dumps(body))

    async def put_route(req: Request) -> None:
        req.respond(200, b"OK", TEXT)

    async def health(req: Request) -> None:
        req.respond(200, b"OK", TEXT)

    def upgrade(req: Request, transport: asyncio.Transport, rest: bytes) -> asyncio.Protocol | None:
        if req.path != "/kv" or req.headers.get("upgrade") != UPGRADE_TOKEN:
            req.keep_alive = False
            req.respond(400, b"unsupported upgrade", TEXT)
            return None
        if engine.faults.active("bootstrap"):
            req.keep_alive = False
            req.respond(503, b"bootstrap refused (fault injection)", TEXT)
            return None
        transport.write(b"HTTP/1.1 101 Switching Protocols\r\nconnection: Upgrade\r\nupgrade: %s\r\n\r\n"
                        % UPGRADE_TOKEN.encode())
        return PrefillChannel(engine.rooms)

    routes: dict[tuple[str, str], Handler] = {
        ("GET", "/route"): get_route, ("PUT", "/route"): put_route, ("GET", "/health"): health}
    return HttpServer(routes, upgrade_handler=upgrade, on_error=_log_error)
