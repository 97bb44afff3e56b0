"""No false positives from the integrity guards: `python -m loadtests.integrity_bench`.

One emulated PD pair in fixed mode with correct pools (prefill at a realistic 20,000 tokens/s), and kvgate with
`integrity.strict`, a prefill ceiling of 50,000 tokens/s and provenance checked on every answer. N ordinary requests
(default 1,000; chat and /generate, streamed and not, prompts of 10 to ~5,000 tokens drawn from a 5,000-word
vocabulary, 20 tenants, the chats sharing a short system prompt) must all succeed with no implausible first token and
no answer flagged as another tenant's.

Final lines (machine-readable): requests=…, ok=…, implausible_ttft=…, provenance_foreign=…, provenance_checks=….
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import yaml

from loadtests.engine.harness import free_port, start_pair
from loadtests.gateway_bench import GLM5_TEMPLATE, GLM5_TOKENIZER, REPO_ROOT, wait_ready

# A vocabulary as varied as prose: with a handful of words, random prompts would share long stretches by chance.
_VOCABULARY = [("".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(2 + i % 7)))
               for i in range(5000)]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(rng.choice((10, 100, 600, 2500))))


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random, i: int) -> int:
    tenant = f"Bearer tenant-{i % 20}"
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        body = {"model": "glm-5", "max_tokens": 16, "stream": stream,
                "messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": _prompt(rng)}]}
        path = "/v1/chat/completions"
    else:
        body = {"text": _prompt(rng), "sampling_params": {"max_new_tokens": 16}, "stream": stream}
        path = "/generate"
    async with session.post(url + path, json=body, headers={"authorization": tenant}) as response:
        await response.read()
        return response.status


async def _run(url: str, n: int, concurrency: int) -> list[int]:
    rng = random.Random(7)
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def guarded(i: int) -> int:
            async with semaphore:
                return await _one(session, url, rng, i)
        return list(await asyncio.gather(*(guarded(i) for i in range(n))))


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with start_pair(prefill_pool=200_000, decode_pool=200_000, context_length=8192, model="glm-5", version="0.5.23",
                    bug=False, prefill_tokens_per_s=20_000) as pair, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        config = Path(tmp) / "kvgate.yaml"
        config.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1", "port": port}, "models": [{
            "name": "glm-5", "tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE),
            "context_length": 8192,
            "integrity": {"max_prefill_tokens_per_s": 50_000, "strict": True, "provenance_sample": 1.0},
            "prefill": [{"url": pair.prefill.url, "bootstrap_port": pair.prefill.bootstrap_port}],
            "decode": [{"url": pair.decode.url}]}]}))
        gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                    "--log-level", "warning"], cwd=REPO_ROOT, env=dict(os.environ))
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, gateway, 60)
            statuses = asyncio.run(_run(url, args.requests, args.concurrency))

            async def scrape() -> str:
                async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
                    return await response.text()

            metrics = asyncio.run(scrape())
        finally:
            gateway.terminate()
            gateway.wait(timeout=60)
    print(f"requests={len(statuses)}")
    print(f"ok={statuses.count(200)}")
    print(f"implausible_ttft={_counter(metrics, 'kvgate_implausible_ttft_total'):g}")
    print(f"provenance_foreign={_counter(metrics, 'kvgate_provenance_foreign_total'):g}")
    print(f"provenance_checks={_counter(metrics, 'kvgate_provenance_checks_total'):g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
