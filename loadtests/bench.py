"""kvgate under load, against the engines directly and a peer router, in one run: `python -m loadtests.bench`.

Starts an emulated SGLang PD pair (decode paced at 1 ms a token, as a real engine streams) and, as "fronts":
`direct` (this client sends both halves itself, with bootstrap fields, as a naive PD client), `kvgate`
(`kvgate serve` in its own process, uvloop + httptools as deployed, with a loop-lag sampler added beside it), and
with `--peer sglang-router` SGLang's Rust router in PD mode (`round_robin`) over the same engines. Each scenario runs
on each front that can run it, sequentially, from this process (aiohttp, keep-alive, fixed concurrency):

    generate16      non-streaming /generate, 16 output tokens, c=64, ~400-character prompts
    chat32_stream   streamed chat completions, 32 output tokens, c=64
    c1_generate     the same /generate at concurrency 1 (added latency over direct)
    c1_chat_stream  the same streamed chat at concurrency 1 (TTFT)
    burst           512 streamed chats released at once
    long            prompts near the model's limit (1,048,576 context; --quick: 256K tokens)
    over_limit_mix  kvgate only: a quarter of the prompts over a 2,048-token limit (413 is the right answer)
    disconnects     kvgate only: clients that leave during prefill, before the first token or mid-stream
    faults          kvgate only: one decode in ten fails (emulator fault injection; 502 is the right answer)

Per row: requests/s, p50/p99 latency and TTFT, the front's CPU seconds per 1,000 requests (utime + stime from
/proc, all threads, background work included), its peak RSS, and kvgate's event-loop lag p99. With a peer, the CPU
ratios kvgate/peer are printed last (they do not depend on how fast the machine is today).

    python -m loadtests.bench --quick                       # ~2 minutes on 2 cores
    python -m loadtests.bench --peer sglang-router          # needs `pip install sglang-router`
    python -m loadtests.bench --peer sglang-router --router-python /tmp/rvenv/bin/python

Final lines (machine-readable): `nonstream_cpu_ms_per_req=…`, `stream32_cpu_ms_per_req=…`, `loop_lag_p99_ms=…`, and
with a peer `peer_nonstream_cpu_ms_per_req=…`, `peer_stream32_cpu_ms_per_req=…`, `nonstream_cpu_ratio=…`,
`stream32_cpu_ratio=…`, `engines_nonstream_cpu_ratio=…` (the engines' CPU per non-streaming request through
kvgate over through the router).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from loadtests.engine.harness import EnginePair, free_port, start_pair
from loadtests.phase_profile import ORDER, PROFILER
from loadtests.procstat import (
    GLM5_TEMPLATE,
    GLM5_TOKENIZER,
    LAG_FILE_ENV,
    PROFILE_FILE_ENV,
    REPO_ROOT,
    cpu_seconds,
    lags_within,
    peak_rss_mib,
    percentile,
    read_lags,
    serve_with_lag_probe,
    stop_process,
    take_profile,
    wait_ready,
)

CONTEXT = 1_048_576
SMALL_LIMIT = 2048
PROMPT = ("You are reviewing a pull request for a gateway that sits in front of prefill and decode engine pools. "
          "Summarise the change below in two sentences, then list any risk to latency or correctness you see, "
          "most serious first, and say whether it is safe to merge before the release freeze on Friday. Change")


@dataclass
class Front:
    name: str
    url: str | None  # None: direct to the engines
    pid: int | None  # the process whose CPU and memory are measured
    profile: Callable[[], dict[str, float]] | None = None  # CPU seconds per phase since the last call (--profile)


@dataclass
class Scenario:
    name: str
    route: str
    stream: bool
    output_tokens: int
    concurrency: int
    requests: int
    fronts: tuple[str, ...] = ("direct", "kvgate", "sglang-router")
    model: str = "glm-5"
    prompt_tokens: int = 0  # 0: the ~400-character prompt; else a prompt of about this many tokens
    expected: tuple[int, ...] = (200,)  # statuses that are the right answer here


@dataclass
class Row:
    scenario: Scenario
    front: Front
    statuses: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float | None = None
    engines_cpu_s: float = 0.0  # both emulated engines' CPU over the row
    rss_mib: float | None = None
    window: tuple[float, float] = (0.0, 0.0)
    phases: dict[str, float] = field(default_factory=dict)  # CPU seconds per phase (--profile)

    @property
    def done(self) -> int:
        return sum(self.statuses.values())

    @property
    def cpu_ms_per_req(self) -> float | None:
        return None if self.cpu_s is None else 1000 * self.cpu_s / max(1, self.done)

    @property
    def engines_cpu_ms_per_req(self) -> float:
        return 1000 * self.engines_cpu_s / max(1, self.done)


class Load:
    def __init__(self, session: aiohttp.ClientSession, pair: EnginePair, long_text: str) -> None:
        self.session = session
        self.pair = pair
        self.long_text = long_text
        self.counter = 0

    def body(self, scenario: Scenario, *, over_limit: bool = False) -> dict[str, Any]:
        self.counter += 1
        prompt = f"{PROMPT} {self.counter}."
        if scenario.prompt_tokens:
            prompt = f"{self.counter} " + self.long_text
        elif over_limit:
            prompt = f"{PROMPT} {self.counter}. " + "lorem ipsum dolor " * 1200
        if scenario.route == "/generate":
            return {"model": scenario.model, "text": prompt, "stream": scenario.stream,
                    "sampling_params": {"max_new_tokens": scenario.output_tokens, "ignore_eos": True}}
        return {"model": scenario.model, "stream": scenario.stream, "max_tokens": scenario.output_tokens,
                "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}

    async def via(self, url: str, scenario: Scenario, body: dict[str, Any], row: Row,
                  leave_after_s: float | None = None) -> None:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(leave_after_s):  # None: no deadline
                async with self.session.post(url + scenario.route, data=orjson.dumps(body),
                                             headers={"content-type": "application/json"}) as response:
                    first = None
                    async for chunk in response.content.iter_any():
                        if first is None and chunk:
                            first = time.perf_counter() - start
                    status = response.status
        except TimeoutError:
            row.statuses["client left"] += 1
            return
        except (aiohttp.ClientError, OSError) as exc:
            row.statuses[type(exc).__name__] += 1
            return
        row.statuses[str(status)] += 1
        if status == 200:
            row.latencies.append(time.perf_counter() - start)
            if scenario.stream and first is not None:
                row.ttfts.append(first)

    async def direct(self, scenario: Scenario, body: dict[str, Any], row: Row) -> None:
        """Both halves at once with one bootstrap room, as a naive PD client (no counting, no verification)."""
        room = random.getrandbits(63)
        prefill = {**body, "bootstrap_host": self.pair.prefill.host, "bootstrap_port": self.pair.prefill.bootstrap_port,
                   "bootstrap_room": room, "stream": False}
        decode = {**prefill, "stream": scenario.stream}
        start = time.perf_counter()

        async def send(url: str, payload: dict[str, Any], timed: bool) -> tuple[int, float | None]:
            async with self.session.post(url + scenario.route, data=orjson.dumps(payload),
                                         headers={"content-type": "application/json"}) as response:
                first = None
                async for chunk in response.content.iter_any():
                    if timed and first is None and chunk:
                        first = time.perf_counter() - start
                return response.status, first

        try:
            (p_status, _), (d_status, first) = await asyncio.gather(send(self.pair.prefill.url, prefill, False),
                                                                    send(self.pair.decode.url, decode, True))
        except (aiohttp.ClientError, OSError) as exc:
            row.statuses[type(exc).__name__] += 1
            return
        status = d_status if d_status != 200 else p_status
        row.statuses[str(status)] += 1
        if status == 200:
            row.latencies.append(time.perf_counter() - start)
            if scenario.stream and first is not None:
                row.ttfts.append(first)


async def run_row(load: Load, scenario: Scenario, front: Front) -> Row:
    """One scenario on one front, on connections of its own (an idle pool left by another row would meet the
    front's keep-alive timeout: a client-side artifact, not the front's doing)."""
    connector = aiohttp.TCPConnector(limit=1024)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        load.session = session
        return await _run_row(load, scenario, front)


async def _run_row(load: Load, scenario: Scenario, front: Front) -> Row:
    row = Row(scenario, front)
    rng = random.Random(scenario.name)

    sent = 0

    def one(into: Row) -> Awaitable[None]:
        nonlocal sent
        sent += 1
        if scenario.name == "faults" and sent % 10 == 0:  # one decode in ten fails, spread out (not in a row)
            _inject(load.pair.decode.url, action="fail", status=500, count=1)
        if front.url is None:
            return load.direct(scenario, load.body(scenario), into)
        if scenario.name == "over_limit_mix":
            return load.via(front.url, scenario, load.body(scenario, over_limit=rng.random() < 0.25), into)
        if scenario.name == "disconnects":  # leaves anywhere from before prefill's end to mid-stream
            return load.via(front.url, scenario, load.body(scenario), into, leave_after_s=rng.uniform(0.001, 0.15))
        return load.via(front.url, scenario, load.body(scenario), into)

    # Warm connections and caches (a long prompt: one, which also starts kvgate's admission worker process).
    warm = 1 if scenario.prompt_tokens else 0 if scenario.name == "faults" else min(scenario.concurrency * 2, 64)
    await _drive(one, warm, scenario.concurrency, Row(scenario, front))
    if front.profile is not None:
        front.profile()  # what the warm-up cost is not this row's
    cpu0 = cpu_seconds(front.pid) if front.pid else None
    engines0 = _engines_cpu(load.pair)
    mono0, wall0 = time.monotonic(), time.perf_counter()
    await _drive(one, scenario.requests, scenario.concurrency, row)
    row.engines_cpu_s = _engines_cpu(load.pair) - engines0
    row.wall_s = time.perf_counter() - wall0
    row.window = (mono0, time.monotonic())
    if front.pid:
        row.cpu_s = cpu_seconds(front.pid) - (cpu0 or 0.0)
        row.rss_mib = peak_rss_mib(front.pid)
    if front.profile is not None:
        row.phases = front.profile()
    return row


def _engines_cpu(pair: EnginePair) -> float:
    return sum(cpu_seconds(engine.proc.pid) for engine in (pair.prefill, pair.decode) if engine.proc is not None)


async def _drive(one: Callable[[Row], Awaitable[None]], count: int, concurrency: int, row: Row) -> None:
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one(row)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def _inject(url: str, **fault: Any) -> None:
    import httpx

    httpx.post(url + "/emu/faults", json=fault, timeout=10).raise_for_status()


def scenarios(quick: bool) -> list[Scenario]:
    scale = 0.25 if quick else 1.0

    def n(count: int) -> int:
        return max(40, int(count * scale))

    return [
        Scenario("generate16", "/generate", False, 16, 64, n(3000)),
        Scenario("chat32_stream", "/v1/chat/completions", True, 32, 64, n(2000)),
        Scenario("c1_generate", "/generate", False, 16, 1, n(300)),
        Scenario("c1_chat_stream", "/v1/chat/completions", True, 32, 1, n(300)),
        Scenario("burst", "/v1/chat/completions", True, 32, 512, 512),
        Scenario("long", "/generate", False, 4, 1, 1 if quick else 2, prompt_tokens=256_000 if quick else 1_040_000),
        Scenario("over_limit_mix", "/v1/chat/completions", False, 16, 16, n(800), fronts=("kvgate",),
                 model="glm-5-small", expected=(200, 413)),
        Scenario("disconnects", "/v1/chat/completions", True, 64, 16, n(800), fronts=("kvgate",)),
        Scenario("faults", "/v1/chat/completions", True, 32, 16, n(800), fronts=("kvgate",), expected=(200, 502)),
    ]


def _long_text(tokens: int) -> str:
    from tokenizers import Tokenizer

    with gzip.open(GLM5_TOKENIZER, "rt", encoding="utf-8") as fh:
        tokenizer = Tokenizer.from_str(fh.read())
    unit = " lorem ipsum dolor sit amet"
    per_unit = len(tokenizer.encode(unit * 1000, add_special_tokens=False).ids) / 1000
    return unit * int(tokens / per_unit)


def _write_config(directory: Path, pair: EnginePair) -> tuple[Path, int]:
    port = free_port()
    workers = {"prefill": [{"url": pair.prefill.url, "bootstrap_port": pair.prefill.bootstrap_port}],
               "decode": [{"url": pair.decode.url}]}
    model = {"tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE), "context_length": CONTEXT,
             "min_engine_version": "0.5.8", **workers}
    # Every simulated client here comes from one address: the per-client connection share (a quarter of the
    # connection cap by default) would answer half of the 512-stream burst 503 and measure the share, not the burst.
    document = {"listen": {"host": "127.0.0.1", "port": port}, "health": {"interval_s": 5},
                "max_connections_per_client": 1024,
                "logging": {"access_log": False}, "gate": {"startup_timeout_s": 60.0},
                "models": [{"name": "glm-5", **model},
                           {"name": "glm-5-small", **model, "max_prompt_tokens": SMALL_LIMIT}]}
    path = directory / "kvgate-bench.yaml"
    path.write_text(yaml.safe_dump(document))
    return path, port


def _start_router(python: str, pair: EnginePair) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [python, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--policy", "round_robin",
         "--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port), "--decode", pair.decode.url,
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, timeout_s=60, path="/health")
    return process, url


def report(rows: list[Row], lags: tuple[list[float], list[float]]) -> None:
    header = (f"{'scenario':<15} {'front':<13} {'ok':>5} {'right':>5} {'other':>5} {'req/s':>7} {'p50 ms':>7} "
              f"{'p99 ms':>7} {'ttft50':>7} {'ttft99':>7} {'CPU s/1k':>8} {'eng s/1k':>8} {'RSS MiB':>7} "
              f"{'lag p99':>7}")
    print()
    print(header)
    print("-" * len(header))
    for row in rows:
        right = sum(n for status, n in row.statuses.items() if status.isdigit() and int(status) in
                    row.scenario.expected and status != "200")
        if row.scenario.name == "disconnects":
            right += row.statuses.get("client left", 0)
        other = row.done - row.statuses.get("200", 0) - right
        window = lags_within(*lags, row.window) if row.front.name == "kvgate" else []

        def ms(values: list[float], q: float) -> str:
            return f"{1000 * percentile(values, q):7.1f}" if values else f"{'-':>7}"

        # CPU seconds per 1,000 requests is numerically the CPU milliseconds per request.
        cpu = f"{row.cpu_ms_per_req:8.3f}" if row.cpu_ms_per_req is not None else f"{'-':>8}"
        rss = f"{row.rss_mib:7.0f}" if row.rss_mib is not None else f"{'-':>7}"
        lag = f"{1000 * percentile(window, 99):7.2f}" if window else f"{'-':>7}"
        print(f"{row.scenario.name:<15} {row.front.name:<13} {row.statuses.get('200', 0):>5} {right:>5} {other:>5} "
              f"{row.done / max(row.wall_s, 1e-9):>7.0f} {ms(row.latencies, 50)} {ms(row.latencies, 99)} "
              f"{ms(row.ttfts, 50)} {ms(row.ttfts, 99)} {cpu} {row.engines_cpu_ms_per_req:8.3f} {rss} {lag}")
        odd = {s: n for s, n in row.statuses.items() if s != "200" and not (s.isdigit() and int(s) in
                                                                          row.scenario.expected)}
        if odd and row.scenario.name != "disconnects":
            print(f"{'':<29} other answers: {dict(odd)}")
    print()
    print("right: the right answer other than 200 (413 over the limit, 502 for an injected engine failure, a client "
          "that left); CPU s/1k: the front's CPU seconds per 1,000 requests; eng s/1k: both engines' CPU seconds per "
          "1,000 requests through that front; lag: kvgate's event-loop timer lag")


_SHORT = {"intake and body": "intake", "admission and count": "admit", "tenancy": "tenant", "pick and lease": "pick",
          "engine client: connect, verify, read": "engine", "exchange and release": "exchange",
          "relay to the client": "relay", "access record and metrics": "record",
          "HTTP framework (ASGI, Starlette, uvicorn)": "http", "event loop and sockets": "loop",
          "other threads": "threads", PROFILER: "(prof)"}


def report_phases(rows: list[Row]) -> None:
    """kvgate's CPU per request by phase (ms), from its sampling profiler; the profiler's own CPU apart."""
    profiled = [r for r in rows if r.phases]
    if not profiled:
        return
    print()
    print("kvgate CPU per request by phase, ms (--profile: the event-loop thread sampled every 2 ms, CPU time)")
    print(f"{'scenario':<15} " + " ".join(f"{_SHORT[p]:>8}" for p in ORDER) + f" {'total':>8}")
    for row in profiled:
        per = {p: 1000 * row.phases.get(p, 0.0) / max(1, row.done) for p in ORDER}
        total = sum(v for p, v in per.items() if p != PROFILER)
        print(f"{row.scenario.name:<15} " + " ".join(f"{per[p]:>8.3f}" for p in ORDER) + f" {total:>8.3f}")
    print("intake: identity, throttle, body; admit: parse, render, count, 413; tenant: limits; pick: route key, "
          "policy, lease, queue; engine: connection, verify, engine reads; exchange: PD orchestration, verify-then-"
          "release; relay: to the client; record: access log, metrics, traces, provenance; http: ASGI, Starlette, "
          "uvicorn; loop: uvloop and sockets in C; threads: counting pools and other threads; (prof): the profiler")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests, a 256K-token long prompt")
    parser.add_argument("--peer", choices=["sglang-router"], default=None)
    parser.add_argument("--router-python", default=sys.executable, help="a Python with sglang-router installed")
    parser.add_argument("--profile", action="store_true",
                        help="also print kvgate's CPU per request split by phase (a sampling profiler in its process)")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # internal: the gateway process
    args = parser.parse_args(argv)
    if args.serve:
        return serve_with_lag_probe(args.serve)
    began = time.monotonic()
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as temp, \
            start_pair(prefill_pool=1_200_000, decode_pool=1_200_000, context_length=CONTEXT, bug=False,
                       model="glm-5", version="0.5.23", token_delay_ms=1) as pair:
        directory = Path(temp)
        try:
            config, port = _write_config(directory, pair)
            lag_file, profile_file = directory / "lags.json", directory / "profile.json"
            env = {**os.environ, LAG_FILE_ENV: str(lag_file)}
            if args.profile:
                env[PROFILE_FILE_ENV] = str(profile_file)
            gateway = subprocess.Popen([sys.executable, "-m", "loadtests.bench", "--serve", str(config)],
                                       cwd=REPO_ROOT, env=env)
            processes.append(gateway)
            kvgate_url = f"http://127.0.0.1:{port}"
            wait_ready(kvgate_url, gateway, timeout_s=90)
            profile = (lambda: take_profile(gateway, profile_file)) if args.profile else None
            fronts = [Front("direct", None, None), Front("kvgate", kvgate_url, gateway.pid, profile)]
            if args.peer:
                router, router_url = _start_router(args.router_python, pair)
                processes.append(router)
                fronts.append(Front("sglang-router", router_url, router.pid))
            long_text = _long_text(256_000 if args.quick else 1_040_000)
            rows = asyncio.run(_run_all(pair, fronts, scenarios(args.quick), long_text))
            lags = read_lags(gateway, lag_file)
            report(rows, lags)
            if args.profile:
                report_phases(rows)
            _summary(rows, lags)
        finally:
            for process in processes:
                stop_process(process)
    print(f"(bench took {time.monotonic() - began:.0f}s on {os.cpu_count()} cores; engines, fronts and this client "
          f"share them)")
    return 0


async def _run_all(pair: EnginePair, fronts: list[Front], plan: list[Scenario], long_text: str) -> list[Row]:
    rows = []
    load = Load(None, pair, long_text)  # type: ignore[arg-type]  # a session per row (run_row)
    for scenario in plan:
        for front in fronts:
            if front.name in scenario.fronts:
                row = await run_row(load, scenario, front)
                print(f"  {scenario.name:<15} {front.name:<13} {row.done} in {row.wall_s:.1f}s", flush=True)
                rows.append(row)
    return rows


def _summary(rows: list[Row], lags: tuple[list[float], list[float]]) -> None:
    def cpu(scenario: str, front: str) -> float | None:
        found = [r for r in rows if r.scenario.name == scenario and r.front.name == front]
        return found[0].cpu_ms_per_req if found else None

    steady = [lag for r in rows if r.front.name == "kvgate" and r.scenario.name in ("generate16", "chat32_stream")
              for lag in lags_within(*lags, r.window)]
    nonstream, stream = cpu("generate16", "kvgate"), cpu("chat32_stream", "kvgate")
    print(f"nonstream_cpu_ms_per_req={nonstream:.3f}")
    print(f"stream32_cpu_ms_per_req={stream:.3f}")
    print(f"loop_lag_p99_ms={1000 * percentile(steady, 99):.3f}")
    peer_nonstream, peer_stream = cpu("generate16", "sglang-router"), cpu("chat32_stream", "sglang-router")
    if peer_nonstream and peer_stream and nonstream and stream:
        print(f"peer_nonstream_cpu_ms_per_req={peer_nonstream:.3f}")
        print(f"peer_stream32_cpu_ms_per_req={peer_stream:.3f}")
        print(f"nonstream_cpu_ratio={nonstream / peer_nonstream:.2f}   (target <= 1.5)")
        print(f"stream32_cpu_ratio={stream / peer_stream:.2f}   (target <= 1.2)")
    engines = {front: [r.engines_cpu_ms_per_req for r in rows if r.scenario.name == "generate16"
                       and r.front.name == front] for front in ("direct", "kvgate", "sglang-router")}
    if engines["kvgate"] and engines["sglang-router"]:
        print(f"engines_nonstream_cpu_ms_per_req=direct:{engines['direct'][0]:.3f} kvgate:{engines['kvgate'][0]:.3f} "
              f"router:{engines['sglang-router'][0]:.3f}")
        print(f"engines_nonstream_cpu_ratio={engines['kvgate'][0] / engines['sglang-router'][0]:.2f}   (target <= 1.1)")


if __name__ == "__main__":
    sys.exit(main())
