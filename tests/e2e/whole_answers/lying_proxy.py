"""A lying engine over real HTTP — a proxy in front of an emulated engine that forwards everything and
rewrites the bytes of each non-streamed generate answer (what a faulty or hostile engine could send)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from loadtests.engine.harness import free_port

Rewrite = Callable[[bytes], bytes]
_GENERATE = ("/generate", "/v1/chat/completions", "/v1/completions")


class LyingProxy:
    def __init__(self, target: str, bootstrap_port: int | None = None) -> None:
        self.target = target
        self.bootstrap_port = bootstrap_port  # a prefill's, passed through to kvgate's config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rewrite: Rewrite | None = None
        self.delay_s = 0.0  # before a rewritten answer is sent
        self.status: int | None = None  # a rewritten answer's status (None: the engine's)
        self.rewrite_streams = False  # rewrite a streamed answer too (read whole, sent at once)
        self.seen: list[dict[str, Any]] = []  # generate bodies as kvgate sent them
        self.aborts: list[bytes] = []
        self._client: httpx.AsyncClient | None = None
        self._server = uvicorn.Server(uvicorn.Config(self._app, host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off", interface="asgi3"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.target, timeout=120)
        request = Request(scope, receive)
        body = await request.body()
        path = request.url.path
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        if path == "/abort_request":
            self.aborts.append(body)
        rewrite = self.rewrite
        parsed: Any = None
        if path in _GENERATE and request.method == "POST":
            parsed = orjson.loads(body)
            self.seen.append(parsed)
        if parsed is not None and rewrite is not None and (not parsed.get("stream") or self.rewrite_streams):
            upstream = await self._client.request(request.method, path, content=body, headers=headers,
                                                  params=dict(request.query_params))
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            out = rewrite(upstream.content)
            status = self.status or upstream.status_code
            media = upstream.headers.get("content-type", "application/json")
            await Response(out, status, media_type=media)(scope, receive, send)
            return
        upstream_request = self._client.build_request(request.method, path, content=body, headers=headers,
                                                      params=dict(request.query_params))
        upstream = await self._client.send(upstream_request, stream=True)
        kept = {k: v for k, v in upstream.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding")}

        async def chunks() -> Any:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        await StreamingResponse(chunks(), upstream.status_code, headers=kept)(scope, receive, send)

    def start(self) -> LyingProxy:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
