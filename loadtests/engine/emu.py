"""Test-only `/emu/*` endpoints: request introspection, fault injection, reset, pool and cache state, KV event hooks."""

from __future__ import annotations

from typing import Any

import orjson

from .engine import Engine
from .faults import Fault, FaultError
from .httpcore import Request


class EmuAPI:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def requests(self, req: Request) -> None:
        q = req.query
        room = q.get("bootstrap_room")
        body = {"requests": self.engine.log.query(q.get("rid"), int(room) if room is not None else None)}
        req.respond(200, orjson.dumps(body))

    async def get_faults(self, req: Request) -> None:
        req.respond(200, orjson.dumps({"faults": [f.to_json() for f in self.engine.faults.rules]}))

    async def add_faults(self, req: Request) -> None:
        """Body: one fault object, or {"faults": [...]} (replacing none: rules accumulate until DELETE/reset)."""
        try:
            body: Any = orjson.loads(req.body)
            items = body["faults"] if isinstance(body, dict) and "faults" in body else [body]
            faults = [Fault.from_json(d) for d in items]
        except (ValueError, TypeError, KeyError, FaultError) as e:
            req.respond(400, orjson.dumps({"error": {"message": str(e)}}))
            return
        for f in faults:
            self.engine.faults.add(f)
        if any(f.action == "refuse_bootstrap" for f in faults):
            self.engine.rooms.close_channels()  # established KV connections break too
        req.respond(200, orjson.dumps({"faults": [f.to_json() for f in faults]}))

    async def clear_faults(self, req: Request) -> None:
        self.engine.faults.clear()
        req.respond(200, b'{"faults":[]}')

    async def reset(self, req: Request) -> None:
        """Clear faults and the request log so a test module can reuse a running engine. KV contents stay."""
        self.engine.faults.clear()
        self.engine.log.clear()
        req.respond(200, b'{"status":"ok"}')

    async def state(self, req: Request) -> None:
        eng = self.engine
        pool = eng.pool
        req.respond(200, orjson.dumps({
            "role": eng.cfg.role, "bug": eng.cfg.bug, "pool_tokens": pool.capacity, "page_size": pool.page_size,
            "free_pages": pool.free_pages, "used_tokens": pool.used_tokens, "waiting_allocations": pool.waiting,
            "inflight": sorted(eng.inflight), "rooms": len(eng.rooms.rooms),
            "max_req_input_len": eng.cfg.max_req_input_len}))

    async def cache(self, req: Request) -> None:
        req.respond(200, orjson.dumps(self.engine.prefix_cache.stats()))

    async def get_kv_events(self, req: Request) -> None:
        pub = self.engine.kv_publisher
        req.respond(200 if pub is not None else 404, orjson.dumps(pub.state() if pub is not None else
                                                                  {"error": {"message": "no KV event publisher"}}))

    async def kv_events(self, req: Request) -> None:
        """Body: any of {"pause": bool, "drop_next": N, "malformed_next": N} (see kv_event_publisher.py)."""
        pub = self.engine.kv_publisher
        if pub is None:
            req.respond(404, orjson.dumps({"error": {"message": "no KV event publisher"}}))
            return
        try:
            body: Any = orjson.loads(req.body or b"{}")
            if not isinstance(body, dict) or not set(body) <= {"pause", "drop_next", "malformed_next"}:
                raise ValueError("expected an object with pause, drop_next and/or malformed_next")
            pause = body.get("pause")
            counts = [body.get(k) for k in ("drop_next", "malformed_next")]
            if pause is not None and not isinstance(pause, bool):
                raise ValueError("pause must be a boolean")
            if any(c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 0) for c in counts):
                raise ValueError("drop_next and malformed_next must be non-negative integers")
        except ValueError as e:
            req.respond(400, orjson.dumps({"error": {"message": str(e)}}))
            return
        if pause is not None:
            pub.paused = pause
        if any(c is not None for c in counts):
            pub.control(*counts)
        req.respond(200, orjson.dumps({"paused": pub.paused, "drop_next": counts[0], "malformed_next": counts[1]}))
