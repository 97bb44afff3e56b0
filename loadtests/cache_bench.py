"""Where prompts' KV is reused, by routing policy: `python -m loadtests.cache_bench [--peer sglang-router]`.

4 emulated prefills whose radix caches hold `--cache-tokens` each (prefill compute = uncached tokens /
`--prefill-tokens-per-s`, one timeline per engine, so imbalance shows as queueing) and 2 decodes, over real HTTP.
Each front serves each workload from cold caches (every prefill's cache flushed, the front started afresh):

    shared-prefix   groups of questions under one long system prompt per group (bench_serving's
                    generated-shared-prefix), interleaved, c=16
    multi-turn      users whose conversations grow turn by turn under one short common system prompt; each user
                    sends its turns in order, all users at once
    uniform         nothing shared, c=16

Fronts: kvgate with `round_robin`, `prefix_affinity`, `cache_aware` (following the engines' KV events, and with
`kv_events: off`: what kvgate sent), a sticky oracle (`session_affinity`, one header value per conversation or
group: what a client that knows its sessions gets), and with `--peer sglang-router` SGLang's Rust router in PD
mode with `--prefill-policy cache_aware`. Decode is round robin everywhere.

Per row: the cache hit ratio as the prefills report it (cached / prompt tokens), the prefill compute seconds that
leaves, TTFT p50/p99 at the client, and requests per prefill (max / mean). Last lines, machine-readable:
`hit_ratio_<workload>_<front>=`, `ttft_p99_ms_<workload>_<front>=`, `prefill_balance_<workload>_<front>=`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import yaml

from loadtests.engine.harness import RunningEngine, free_port, start_engine
from loadtests.procstat import GLM5_TEMPLATE, GLM5_TOKENIZER, REPO_ROOT, percentile, stop_process, wait_ready

MODEL = "glm-5"
CONTEXT = 131072
WORDS = ("sea sky river stone light wind tree cloud field road city house door table window paper letter music "
         "story garden winter summer market bridge island forest mountain valley harbor engine signal number").split()
SESSION_HEADER = "x-session"


@dataclass(frozen=True)
class Request:
    messages: list[dict[str, str]]
    session: str  # the conversation or group: what the sticky oracle keys on
    after: int | None = None  # multi-turn: the index of the request this one must wait for


@dataclass
class Workload:
    name: str
    requests: list[Request]
    concurrency: int


@dataclass
class Result:
    workload: str
    front: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_prefill: list[int] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    failures: int = 0
    wall_s: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def balance(self) -> float:
        mean = sum(self.per_prefill) / max(1, len(self.per_prefill))
        return max(self.per_prefill, default=0) / mean if mean else 0.0


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workloads(scale: float, seed: int = 1) -> list[Workload]:
    rng = random.Random(seed)
    groups, per_group = max(4, int(16 * scale)), max(4, int(12 * scale))
    shared = []
    systems = [f"System prompt of team {g}. " + _text(rng, 1800) for g in range(groups)]
    for q in range(per_group):
        for g in rng.sample(range(groups), groups):
            shared.append(Request([{"role": "system", "content": systems[g]},
                                   {"role": "user", "content": f"Question {q}: " + _text(rng, 80)}], f"group-{g}"))
    users, turns = max(4, int(20 * scale)), 8
    system = "You are a helpful assistant of Example Corp. " + _text(rng, 250)
    multi: list[Request] = []
    for u in range(users):
        history = [{"role": "system", "content": system}]
        previous = None
        for t in range(turns):
            history = [*history, {"role": "user", "content": f"User {u} turn {t}: " + _text(rng, 120)}]
            multi.append(Request(list(history), f"user-{u}", after=previous))
            previous = len(multi) - 1
            history = [*history, {"role": "assistant", "content": _text(rng, 150)}]
    uniform = [Request([{"role": "user", "content": f"Unique {i}: " + _text(rng, 900)}], f"one-{i}")
               for i in range(max(16, int(160 * scale)))]
    return [Workload("shared-prefix", shared, 16), Workload("multi-turn", multi, users),
            Workload("uniform", uniform, 16)]


# ── fronts ────────────────────────────────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class FrontSpec:
    name: str
    prefill_policy: str | None = None  # kvgate's; None: the peer router
    kv_events: str = "auto"
    sticky: bool = False


KVGATE_FRONTS = (FrontSpec("round_robin", "round_robin"), FrontSpec("prefix_affinity", "prefix_affinity"),
                 FrontSpec("cache_aware", "cache_aware"),
                 FrontSpec("cache_aware_approx", "cache_aware", kv_events="off"),
                 FrontSpec("sticky_oracle", "session_affinity", sticky=True))
PEER = FrontSpec("sglang-router")


def _kvgate_config(directory: Path, spec: FrontSpec, prefills: list[RunningEngine],
                   decodes: list[RunningEngine]) -> tuple[Path, int]:
    port = free_port()
    routing: dict[str, Any] = {"prefill_policy": spec.prefill_policy, "decode_policy": "round_robin",
                               "kv_events": spec.kv_events}
    if spec.sticky:
        routing["affinity_header"] = SESSION_HEADER
    document = {"listen": {"host": "127.0.0.1", "port": port}, "health": {"interval_s": 2},
                "logging": {"access_log": False}, "gate": {"startup_timeout_s": 60.0},
                "models": [{"name": MODEL, "tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE),
                            "context_length": CONTEXT, "min_engine_version": "0.5.8", "routing": routing,
                            "prefill": [{"url": p.url, "bootstrap_port": p.bootstrap_port} for p in prefills],
                            "decode": [{"url": d.url} for d in decodes]}]}
    path = directory / f"kvgate-{spec.name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path, port


def _start_front(spec: FrontSpec, directory: Path, prefills: list[RunningEngine], decodes: list[RunningEngine],
                 router_python: str) -> tuple[subprocess.Popen[bytes], str]:
    if spec.prefill_policy is None:
        port = free_port()
        command = [router_python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                   "--prefill-policy", "cache_aware", "--decode-policy", "round_robin",
                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
        for p in prefills:
            command += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in decodes:
            command += ["--decode", d.url]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process, timeout_s=60, path="/health")
        return process, url
    config, port = _kvgate_config(directory, spec, prefills, decodes)
    process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                "--log-level", "warning"], cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, timeout_s=90)
    return process, url


def _stop(process: subprocess.Popen[bytes]) -> None:
    stop_process(process)


# ── one run ───────────────────────────────────────────────────────────────────────────────────────────────────
async def _send(session: aiohttp.ClientSession, url: str, request: Request, sticky: bool) -> float | None:
    body = {"model": MODEL, "messages": request.messages, "max_tokens": 4, "stream": True}
    headers = {SESSION_HEADER: request.session} if sticky else {}
    started = time.perf_counter()
    first: float | None = None
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json", **headers}) as response:
        if response.status != 200:
            await response.read()
            return None
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - started
    return first


async def _run(url: str, workload: Workload, sticky: bool) -> tuple[list[float], int, float]:
    done: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(len(workload.requests))}
    ttfts: list[float] = []
    failures = 0
    gate = asyncio.Semaphore(workload.concurrency)
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def one(index: int, request: Request) -> None:
            nonlocal failures
            if request.after is not None:
                await done[request.after].wait()
            async with gate:
                ttft = await _send(session, url, request, sticky)
            if ttft is None:
                failures += 1
            else:
                ttfts.append(ttft)
            done[index].set()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(workload.requests)))
    return ttfts, failures, time.perf_counter() - started


def _prefill_records(prefill: RunningEngine) -> list[dict[str, Any]]:
    answer = httpx.get(f"{prefill.url}/emu/requests", timeout=30).json()
    return [r for r in answer["requests"] if r.get("role") == "prefill" and r.get("prompt_tokens")]


def _reset(prefills: list[RunningEngine]) -> None:
    for prefill in prefills:
        httpx.post(f"{prefill.url}/flush_cache", timeout=30).raise_for_status()
        httpx.post(f"{prefill.url}/emu/reset", timeout=30).raise_for_status()


def _warm_up(url: str, timeout_s: float = 60.0) -> None:
    """Until the front serves: sglang-router's /health answers before its workers are in rotation."""
    deadline = time.monotonic() + timeout_s
    body = {"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}
    while True:
        try:
            if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not serve a chat within {timeout_s:.0f}s")
        time.sleep(0.25)


def run_one(spec: FrontSpec, workload: Workload, directory: Path, prefills: list[RunningEngine],
            decodes: list[RunningEngine], router_python: str) -> Result:
    _reset(prefills)
    process, url = _start_front(spec, directory, prefills, decodes, router_python)
    try:
        _warm_up(url)
        _reset(prefills)  # the warm-up's few tokens leave no trace in the figures
        time.sleep(0.5)  # KV-event subscriptions settle (a SUB misses what is published before it joins)
        ttfts, failures, wall_s = asyncio.run(_run(url, workload, spec.sticky))
    finally:
        _stop(process)
    result = Result(workload.name, spec.name, ttfts=ttfts, failures=failures, wall_s=wall_s)
    for prefill in prefills:
        records = _prefill_records(prefill)
        result.per_prefill.append(len(records))
        result.prompt_tokens += sum(r["prompt_tokens"] for r in records)
        result.cached_tokens += sum(r.get("cached_tokens") or 0 for r in records)
    return result


def report(results: list[Result], tokens_per_s: float) -> None:
    header = (f"{'workload':<14} {'front':<19} {'hit ratio':>9} {'prefill s':>9} {'ttft p50':>9} {'ttft p99':>9} "
              f"{'per prefill':>17} {'max/mean':>8} {'fail':>4}")
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        compute = (r.prompt_tokens - r.cached_tokens) / tokens_per_s
        print(f"{r.workload:<14} {r.front:<19} {r.hit_ratio:>9.3f} {compute:>9.2f} "
              f"{1000 * percentile(r.ttfts, 50):>7.1f}ms {1000 * percentile(r.ttfts, 99):>7.1f}ms "
              f"{'/'.join(map(str, r.per_prefill)):>17} {r.balance:>8.2f} {r.failures:>4}")
    print()
    for r in results:
        key = f"{r.workload}_{r.front}".replace("-", "_")
        print(f"hit_ratio_{key}={r.hit_ratio:.3f}")
        print(f"ttft_p99_ms_{key}={1000 * percentile(r.ttfts, 99):.1f}")
        print(f"prefill_balance_{key}={r.balance:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.cache_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--peer", choices=["sglang-router"], default=None)
    parser.add_argument("--router-python", default=sys.executable, help="a Python with sglang-router installed")
    parser.add_argument("--quick", action="store_true", help="a third of the requests")
    parser.add_argument("--cache-tokens", type=int, default=16384, help="each prefill's radix cache")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=200_000.0)
    parser.add_argument("--fronts", default=",".join(f.name for f in KVGATE_FRONTS),
                        help="kvgate fronts to run, comma-separated")
    args = parser.parse_args(argv)
    began = time.monotonic()
    fronts = [f for f in KVGATE_FRONTS if f.name in args.fronts.split(",")] + ([PEER] if args.peer else [])
    plan = workloads(1 / 3 if args.quick else 1.0)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-cache-bench-") as temp, ExitStack() as engines:
        prefills, decodes = _start_engines(engines, args.cache_tokens, args.prefill_tokens_per_s)
        for workload in plan:
            for spec in fronts:
                result = run_one(spec, workload, Path(temp), prefills, decodes, args.router_python)
                print(f"  {workload.name:<14} {spec.name:<19} hit {result.hit_ratio:.3f} in {result.wall_s:.1f}s",
                      flush=True)
                results.append(result)
    report(results, args.prefill_tokens_per_s)
    print(f"(cache bench took {time.monotonic() - began:.0f}s on {os.cpu_count()} cores)")
    return 0


def _start_engines(stack: ExitStack, cache_tokens: int,
                   tokens_per_s: float) -> tuple[list[RunningEngine], list[RunningEngine]]:
    prefills, decodes = [], []
    for _ in range(4):
        events = {"publisher": "zmq", "endpoint": f"tcp://*:{free_port()}",
                  "replay_endpoint": f"tcp://*:{free_port()}", "topic": ""}
        engine = start_engine("prefill", pool_tokens=262_144, context_length=CONTEXT, bug=False, model=MODEL,
                              version="0.5.23", cache_tokens=cache_tokens, prefill_tokens_per_s=tokens_per_s,
                              kv_events_config=events)
        stack.callback(engine.stop)
        prefills.append(engine)
    for _ in range(2):
        engine = start_engine("decode", pool_tokens=262_144, context_length=CONTEXT, bug=False, model=MODEL,
                              version="0.5.23", token_delay_ms=1)
        stack.callback(engine.stop)
        decodes.append(engine)
    return prefills, decodes


if __name__ == "__main__":
    sys.exit(main())
