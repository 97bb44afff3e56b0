"""Overload without collapse: `python -m loadtests.overload_bench` (issue 10's 5,000-stream check).

Starts one emulated SGLang PD pair and kvgate (`gateway.cli serve`, default limits: 1,024 connections, 1,024
requests in flight per worker, a wait queue of 1,024), then opens N streams at once (default 5,000; streamed
`/generate`, 16 tokens each) from this process. A gateway that opens a connection per request, or that mistakes a full
worker for a failing one, answers some of them 502 and takes the worker out of rotation; kvgate must answer only 200
(complete streams) or 503 with Retry-After, and keep both workers in rotation (read from /admin/workers).

    python -m loadtests.overload_bench                            # the connection cap answers first
    python -m loadtests.overload_bench --max-connections 8192     # the per-worker limit and wait queue answer

Final lines (machine-readable): streams=…, ok=…, overloaded=…, other=…, retry_after_missing=…, incomplete_streams=…,
workers_in_rotation=…/….
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import yaml

from loadtests.engine.harness import free_port, start_pair
from loadtests.procstat import GLM5_TEMPLATE, GLM5_TOKENIZER, REPO_ROOT, peak_rss_mib, wait_ready

ADMIN_TOKEN = "overload-bench"


async def one_stream(session: aiohttp.ClientSession, url: str, tokens: int) -> tuple[int, bool, bool]:
    """(status, Retry-After present, stream complete)"""
    body = {"text": "Count to sixteen.", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
            "stream": True}
    try:
        async with session.post(url + "/generate", json=body) as response:
            data = await response.read()
            return response.status, "retry-after" in response.headers, data.endswith(b"data: [DONE]\n\n")
    except (TimeoutError, aiohttp.ClientError):
        return -1, False, False  # a connection the gateway dropped: counted as "other"


async def storm(url: str, streams: int, tokens: int) -> list[tuple[int, bool, bool]]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return list(await asyncio.gather(*(one_stream(session, url, tokens) for _ in range(streams))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=5000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--max-connections", type=int, default=1024,
                        help="the gateway's max_connections (raise it to exercise the per-worker limit and queue)")
    parser.add_argument("--max-inflight", type=int, default=1024,
                        help="limits.max_inflight_per_worker (raise it with --max-connections to hold every stream)")
    args = parser.parse_args()
    with start_pair(prefill_pool=400_000, decode_pool=400_000, context_length=8192, model="glm-5",
                    version="0.5.23", token_delay_ms=5) as pair, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        config = Path(tmp) / "kvgate.yaml"
        config.write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": port}, "admin": {"token_env": "KVGATE_BENCH_ADMIN_TOKEN"},
            "max_connections": args.max_connections,
            # Every stream here comes from one address: its share of the connections (a quarter by default) would
            # answer most of them 503 and measure the share, not the gateway's limits.
            "max_connections_per_client": args.max_connections,
            "models": [{"name": "glm-5", "tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE),
                        "context_length": 8192, "limits": {"max_inflight_per_worker": args.max_inflight},
                        "prefill": [{"url": pair.prefill.url, "bootstrap_port": pair.prefill.bootstrap_port}],
                        "decode": [{"url": pair.decode.url}]}]}))
        env = {**os.environ, "KVGATE_BENCH_ADMIN_TOKEN": ADMIN_TOKEN}
        gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                    "--log-level", "warning"], cwd=REPO_ROOT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, gateway, 60)
            print(f"{args.streams} streams at once through one PD pair, {args.tokens} tokens each ...", flush=True)
            started = time.monotonic()
            results = asyncio.run(storm(url, args.streams, args.tokens))
            took = time.monotonic() - started
            workers = asyncio.run(_workers(url))
            peak_rss = peak_rss_mib(gateway.pid)
        finally:
            gateway.terminate()
            gateway.wait(timeout=60)
    statuses = Counter(status for status, _, _ in results)
    ok = statuses[200]
    overloaded = statuses[503]
    print(f"statuses: {dict(sorted(statuses.items()))} in {took:.1f}s")
    print(f"streams={len(results)}")
    print(f"ok={ok}")
    print(f"overloaded={overloaded}")
    print(f"other={len(results) - ok - overloaded}")
    print(f"retry_after_missing={sum(1 for s, retry, _ in results if s == 503 and not retry)}")
    print(f"incomplete_streams={sum(1 for s, _, done in results if s == 200 and not done)}")
    print(f"workers_in_rotation={sum(1 for w in workers if w['in_rotation'])}/{len(workers)}")
    print(f"gateway_peak_rss_mib={peak_rss:.0f}")
    return 0


async def _workers(url: str) -> list[dict[str, object]]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/admin/workers",
                               headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as response:
            payload = await response.json()
            return list(payload["workers"])


if __name__ == "__main__":
    sys.exit(main())
