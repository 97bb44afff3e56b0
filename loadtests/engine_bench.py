"""Throughput of an emulated prefill+decode pair driven like a naive PD router.

    python -m loadtests.engine_bench [--duration 8] [--concurrency 64] [--tokens 32]

Starts a pair (zero delays), then for each scenario runs `concurrency` workers, each sending both halves of a
request at once with the same bootstrap room over its own keep-alive connections, and prints requests/s.
The client is a minimal asyncio + httptools one so that it costs little next to the engines it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any

import httptools
import orjson

from loadtests.engine.harness import EnginePair, start_pair


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 client connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.waiter is not None
        self.waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))
        self.body = []

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    def post(self, head: bytes, body: bytes) -> asyncio.Future[tuple[int, bytes]]:
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        return self.waiter


async def _connect(host: str, port: int) -> _Conn:
    _, conn = await asyncio.get_running_loop().create_connection(_Conn, host, port)
    return conn


@dataclass
class Scenario:
    name: str
    path: str
    body: dict[str, Any]
    stream: bool


def _check(status: int, body: bytes, stream: bool, tokens: int) -> bool:
    if status != 200:
        return False
    if not stream:
        return True
    return body.endswith(b"data: [DONE]\n\n") and body.count(b'"content"') >= tokens + 1


async def _run(pair: EnginePair, sc: Scenario, concurrency: int, duration: float, tokens: int) -> tuple[int, int]:
    rooms = itertools.count(1_000_000)
    host = pair.prefill.host
    head = (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" % sc.path.encode())
    ok = bad = 0
    stop_at = 0.0

    async def worker() -> None:
        nonlocal ok, bad
        p = await _connect(host, pair.prefill.port)
        d = await _connect(host, pair.decode.port)
        while time.monotonic() < stop_at:
            body = orjson.dumps({**sc.body, **pair.bootstrap_fields(next(rooms))})
            fp, fd = p.post(head, body), d.post(head, body)
            (sp, _), (sd, bd) = await fp, await fd
            if sp == 200 and _check(sd, bd, sc.stream, tokens):
                ok += 1
            else:
                bad += 1
        p.transport.close()  # type: ignore[union-attr]
        d.transport.close()  # type: ignore[union-attr]

    stop_at = time.monotonic() + duration
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per scenario")
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    scenarios = [
        Scenario("generate (non-stream)", "/generate",
                 {"text": "The quick brown fox jumps over the lazy dog.",
                  "sampling_params": {"max_new_tokens": args.tokens}}, False),
        Scenario(f"chat stream ({args.tokens} tokens)", "/v1/chat/completions",
                 {"model": "glm-5-emu", "messages": [{"role": "user", "content": "Tell me a story about a fox."}],
                  "max_tokens": args.tokens, "stream": True}, True),
    ]
    with start_pair(prefill_pool=1 << 20, decode_pool=1 << 20, context_length=1 << 17, health_delay_s=0) as pair:
        for sc in scenarios:
            asyncio.run(_run(pair, sc, args.concurrency, args.warmup, args.tokens))
            t0 = time.monotonic()
            ok, bad = asyncio.run(_run(pair, sc, args.concurrency, args.duration, args.tokens))
            elapsed = time.monotonic() - t0
            print(f"{sc.name:28s} concurrency={args.concurrency}  {ok / elapsed:8.0f} req/s  "
                  f"(ok={ok} failed={bad} in {elapsed:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
