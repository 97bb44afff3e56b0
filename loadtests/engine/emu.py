"""Test-only `/emu/*` endpoints: request introspection, fault injection, reset, pool state."""

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
