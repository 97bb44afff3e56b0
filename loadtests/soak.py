"""A soak with faults and disconnects mixed in: `python -m loadtests.soak [--seconds S]` (default 600).

Starts an emulated PD pair in bug mode (the incident's engines: KV pools smaller than the context, the leak bug on),
`kvgate serve` in front (the KV-pool gate clamps the limit; the background canary probes every 5 s) and drives a
mix at concurrency 16 for S seconds: streamed and whole chats and /generate, prompts over the limit (413), clients
that leave at a random moment, and engine faults injected on both halves (500s, dropped streams, hangs that end in
timeouts). Then it waits for things to settle and asserts:

- no growth of the gateway's open file descriptors (≤ 16 over the warm start) and RSS within bounds (≤ 200 MiB over
  the warm start);
- no requests left held or registered: every worker's in-flight count is 0, both engines hold no KV tokens;
- every engine request finished or was aborted (none left running);
- zero HTTP 200 answers to failed requests: a whole answer with an error inside, or a stream that ended without
  `[DONE]` and without an error event (a silent truncation);
- zero canary leaks (`kvgate_canary_leaks_total`), with canary probes having run.

Final lines (machine-readable): the figures, then `soak_ok=1` (exit 0) or `soak_ok=0` with the failed checks
(exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import yaml

from loadtests.engine.harness import EnginePair, free_port, start_pair
from loadtests.procstat import GLM5_TEMPLATE, GLM5_TOKENIZER, REPO_ROOT, open_fds, rss_mib, stop_process, wait_ready

ADMIN_TOKEN = "soak-admin"
POOL, CONTEXT = 16_384, 32_768
CONCURRENCY = 16
FAULTS = [  # (role, fault) — injected one at a time, each for the next matching request only
    ("prefill", {"action": "fail", "status": 500}),
    ("decode", {"action": "fail", "status": 500}),
    ("decode", {"action": "drop", "after_chunks": 3}),
    ("prefill", {"action": "hang"}),
    ("decode", {"action": "hang"}),
    ("decode", {"action": "error_body", "status": 200}),
]


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.violations: list[str] = []


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally, n: int) -> None:
    kind = rng.choices(["chat_stream", "chat", "generate", "over_limit"], weights=[5, 3, 3, 1])[0]
    text = f"Request {n}: summarise why a gateway must count prompts before engines see them. " * rng.randint(1, 20)
    if kind == "over_limit":
        text = "lorem ipsum dolor sit amet " * 9000  # ~45K tokens: over the clamped limit
    stream = kind == "chat_stream" or (kind == "generate" and rng.random() < 0.5)
    if kind == "generate":
        route, body = "/generate", {"text": text, "stream": stream,
                                    "sampling_params": {"max_new_tokens": rng.randint(1, 48)}}
    else:
        route, body = "/v1/chat/completions", {"model": "glm-5", "stream": stream, "max_tokens": rng.randint(1, 48),
                                               "messages": [{"role": "user", "content": text}]}
    leave_after = rng.uniform(0.0, 0.2) if rng.random() < 0.15 else None
    try:
        async with asyncio.timeout(leave_after):
            async with session.post(url + route, data=orjson.dumps(body),
                                    headers={"content-type": "application/json"}) as response:
                payload = await response.read()
                status = response.status
    except TimeoutError:
        tally.outcomes["client left"] += 1
        return
    except (aiohttp.ClientError, OSError) as exc:
        tally.outcomes[type(exc).__name__] += 1
        return
    tally.outcomes[str(status)] += 1
    if status != 200:
        return
    if stream:
        ended = payload.endswith(b"data: [DONE]\n\n")
        errored = b'data: {"error"' in payload
        if not ended and not errored:
            tally.violations.append(f"200 stream ended silently ({route}, {len(payload)} bytes)")
        elif ended and errored:
            tally.violations.append(f"200 stream with an error event and [DONE] ({route})")
    elif payload[:9] == b'{"error":' or b'"finish_reason":{"type":"abort"' in payload:
        tally.violations.append(f"200 whole answer carrying a failure ({route}): {payload[:120]!r}")


async def _drive(url: str, pair: EnginePair, seconds: float, tally: Tally) -> None:
    rng = random.Random(11)
    deadline = time.monotonic() + seconds
    counter = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal counter
        while time.monotonic() < deadline:
            counter += 1
            await _one(session, url, rng, tally, counter)

    async def faults() -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while time.monotonic() < deadline:
                await asyncio.sleep(rng.uniform(0.2, 0.6))
                role, fault = rng.choice(FAULTS)
                engine = pair.prefill if role == "prefill" else pair.decode
                await http.post(engine.url + "/emu/faults", json={**fault, "count": 1})
                tally.outcomes[f"fault injected: {role} {fault['action']}"] += 1

    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(faults(), *(client(session) for _ in range(CONCURRENCY)))


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and re.match(rf"{name}(\{{|\s)", line))


def _config(directory: Path, pair: EnginePair) -> tuple[Path, int]:
    port = free_port()
    document = {
        "listen": {"host": "127.0.0.1", "port": port},
        "timeouts": {"prefill_s": 4, "first_token_s": 5, "idle_s": 3, "total_s": 30, "abort_s": 2},
        "health": {"interval_s": 1, "timeout_s": 3, "failure_threshold": 3, "success_threshold": 1},
        "logging": {"access_log": False},
        "models": [{"name": "glm-5", "tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE),
                    "context_length": CONTEXT, "on_pool_mismatch": "clamp", "min_engine_version": "0.5.8",
                    "circuit_breaker": {"failure_threshold": 50, "success_threshold": 1, "open_s": 1},
                    "integrity": {"canary_interval_s": 5},
                    "prefill": [{"url": pair.prefill.url, "bootstrap_port": pair.prefill.bootstrap_port}],
                    "decode": [{"url": pair.decode.url}]}],
    }
    path = directory / "kvgate-soak.yaml"
    path.write_text(yaml.safe_dump(document))
    return path, port


def run(seconds: float) -> int:
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as temp, \
            start_pair(prefill_pool=POOL, decode_pool=POOL, context_length=CONTEXT, bug=True, model="glm-5",
                       version="0.5.23", token_delay_ms=2) as pair:
        config, port = _config(Path(temp), pair)
        url = f"http://127.0.0.1:{port}"
        gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                    "--log-level", "warning"], cwd=REPO_ROOT,
                                   env={**os.environ, "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN})
        try:
            wait_ready(url, gateway, timeout_s=90)
            warm = Tally()
            asyncio.run(_drive(url, pair, min(10.0, seconds / 6), warm))  # connections, caches, admission workers
            time.sleep(1.0)
            fds0, rss0 = open_fds(gateway.pid), rss_mib(gateway.pid)
            tally = Tally()
            started = time.monotonic()
            asyncio.run(_drive(url, pair, seconds, tally))
            elapsed = time.monotonic() - started
            failures += _settle_and_check(url, pair, gateway.pid, fds0, rss0, tally)
            print(f"requests={sum(n for k, n in tally.outcomes.items() if not k.startswith('fault'))} "
                  f"in {elapsed:.0f}s; outcomes: {dict(sorted(tally.outcomes.items()))}")
        finally:
            stop_process(gateway, timeout_s=30)
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"soak_ok={int(not failures)}")
    return 0 if not failures else 1


def _settle_and_check(url: str, pair: EnginePair, pid: int, fds0: int, rss0: float, tally: Tally) -> list[str]:
    failures = list(tally.violations)
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    deadline = time.monotonic() + 15  # hung halves end by their timeouts; aborts go out
    workers: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        workers = httpx.get(url + "/admin/workers", headers=admin, timeout=5).json()["workers"]
        held = sum(w["in_flight"] for w in workers)
        used = sum(httpx.get(e.url + "/emu/state", timeout=5).json()["used_tokens"]
                   for e in (pair.prefill, pair.decode))
        running = [r for e in (pair.prefill, pair.decode) for r in httpx.get(e.url + "/emu/requests", timeout=5)
                   .json()["requests"] if r["outcome"] is None]
        if held == 0 and used == 0 and not running:
            break
        time.sleep(0.5)
    # Idle keep-alive connections (to the engines, from the clients) close within seconds: growth that stays is a leak.
    deadline = time.monotonic() + 15
    while (fds1 := open_fds(pid)) > fds0 + 16 and time.monotonic() < deadline:
        time.sleep(0.5)
    rss1 = rss_mib(pid)
    metrics = httpx.get(url + "/metrics", timeout=5).text
    print(f"fds {fds0} -> {fds1}; rss {rss0:.0f} -> {rss1:.0f} MiB; held {held}; engine KV tokens in use {used}; "
          f"engine requests running {len(running)}; canary probes {_metric(metrics, 'kvgate_canary_probes_total'):.0f}"
          f", leaks {_metric(metrics, 'kvgate_canary_leaks_total'):.0f}; "
          f"200s to failed requests {len(tally.violations)}")
    if fds1 > fds0 + 16:
        failures.append(f"open file descriptors grew from {fds0} to {fds1}")
    if rss1 > rss0 + 200:
        failures.append(f"RSS grew from {rss0:.0f} to {rss1:.0f} MiB")
    if held:
        failures.append(f"{held} request(s) still held by the gateway: {[w['url'] for w in workers if w['in_flight']]}")
    if used:
        failures.append(f"engines still hold {used} KV tokens")
    if running:
        failures.append(f"{len(running)} engine request(s) neither finished nor aborted")
    if _metric(metrics, "kvgate_canary_leaks_total"):
        failures.append("the canary found a leak")
    if not _metric(metrics, "kvgate_canary_probes_total"):
        failures.append("no canary probe ran")
    if tally.outcomes.get("200", 0) == 0:
        failures.append("nothing was served")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to drive traffic (default 600)")
    args = parser.parse_args(argv)
    return run(args.seconds)


if __name__ == "__main__":
    sys.exit(main())
