"""Reading what the emulated engines recorded (GET /emu/requests) and injecting faults (POST /emu/faults)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import httpx

from loadtests.engine.harness import EnginePair, naive_pd_request


def records(engine: Any, rid: str | None = None) -> list[dict[str, Any]]:
    """What an engine (or the engine at a URL) recorded, optionally only the rids starting with `rid`."""
    url = engine if isinstance(engine, str) else engine.url
    params = {"rid": rid} if rid else {}
    return httpx.get(url + "/emu/requests", params=params, timeout=10).json()["requests"]


def pd_request(pair: EnginePair, path: str, body: dict[str, Any], room: int) -> tuple[tuple[int, bytes],
                                                                                     tuple[int, bytes]]:
    """Both halves at once with the same room, as a naive PD router sends them: ((status, body), (status, body))."""
    async def both() -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        async with aiohttp.ClientSession() as session:
            return await naive_pd_request(session, pair, path, body, room)

    return asyncio.run(both())


def generation_records(engine: Any) -> list[dict[str, Any]]:
    """Records of generate requests sent by the gateway (its rids start with kvg-)."""
    return [r for r in records(engine, "kvg-")]


def inject(engine: Any, **fault: Any) -> None:
    response = httpx.post(engine.url + "/emu/faults", json=fault, timeout=10)
    assert response.status_code == 200, response.text


def reset(*engines: Any) -> None:
    for engine in engines:
        assert httpx.post(engine.url + "/emu/reset", timeout=10).status_code == 200


def wait_for(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
