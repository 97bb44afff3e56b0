"""What verify-then-release costs in time to first token: `python -m loadtests.release_bench`.

One emulated PD pair with a paced prefill (20,000 prompt tokens/s: a ~1,000-token prompt takes ~50 ms) and paced
decode tokens, behind `kvgate serve` serving it as two models that differ only in `release`: `verified` (no decode
byte before prefill has answered and every engine count matched) and `immediate`. Streamed chat requests alternate
between the two; the client times the first content byte. In PD the prefill answers right after the KV transfer,
which is also when decode can produce its first token, so the cost is the gap between those two events.

Last line (read by tools): `ttft_verified_p50_ms=… ttft_immediate_p50_ms=… ttft_cost_p50_ms=… ttft_cost_p99_ms=…`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from loadtests.engine.harness import EnginePair, free_port, start_pair
from loadtests.loop_bench import GLM5_TEMPLATE, GLM5_TOKENIZER, percentile, running_gateway_process

PROMPT = "Summarise the history of the gateway in a paragraph, then list three risks. " * 60  # ~1,000 tokens


def write_config(directory: Path, pair: EnginePair) -> tuple[Path, int]:
    port = free_port()
    workers = {"prefill": [{"url": pair.prefill.url, "bootstrap_port": pair.prefill.bootstrap_port}],
               "decode": [{"url": pair.decode.url}]}
    models = [{"name": f"glm-5-{release}", "tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE),
               "context_length": 8192, "release": release, **workers} for release in ("verified", "immediate")]
    path = directory / "kvgate-release-bench.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": port}, "models": models}))
    return path, port


async def first_byte_s(session: aiohttp.ClientSession, url: str, model: str, n: int) -> float:
    body = {"model": model, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": f"{n} {PROMPT}"}]}
    start = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        first = None
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
        assert first is not None
        return first


async def measure(url: str, requests: int, concurrency: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {"verified": [], "immediate": []}
    counter = iter(range(requests))

    async def client(session: aiohttp.ClientSession) -> None:
        for n in counter:
            release = "verified" if n % 2 == 0 else "immediate"
            results[release].append(await first_byte_s(session, url, f"glm-5-{release}", n))

    async with aiohttp.ClientSession() as session:
        for n in range(4):  # warm-up: connections, caches
            await first_byte_s(session, url, f"glm-5-{'verified' if n % 2 else 'immediate'}", -n - 1)
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.release_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, \
            start_pair(prefill_pool=200_000, decode_pool=200_000, context_length=8192, model="glm-5",
                       version="0.5.23", prefill_tokens_per_s=20_000, first_token_delay_ms=2,
                       token_delay_ms=5) as pair:
        config, port = write_config(Path(tmp), pair)
        with running_gateway_process(config, port):
            results = asyncio.run(measure(f"http://127.0.0.1:{port}", args.requests, args.concurrency))
    verified, immediate = (sorted(1000 * s for s in results[r]) for r in ("verified", "immediate"))
    for name, values in (("verified", verified), ("immediate", immediate)):
        print(f"release {name:9s} n={len(values):4d} ttft p50={percentile(values, 50):6.1f} ms "
              f"p99={percentile(values, 99):6.1f} ms")
    print(f"ttft_verified_p50_ms={percentile(verified, 50):.1f} ttft_immediate_p50_ms={percentile(immediate, 50):.1f} "
          f"ttft_cost_p50_ms={percentile(verified, 50) - percentile(immediate, 50):.1f} "
          f"ttft_cost_p99_ms={percentile(verified, 99) - percentile(immediate, 99):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
