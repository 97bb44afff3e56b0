"""Throughput of `kvgate serve --workers N` for N = 1 and 2: `python -m loadtests.workers_bench [--seconds S]`.

Two emulated PD pairs (decode with no token delay, so the gateway, not the engines, is the bottleneck) and kvgate
started as `python -m gateway.cli serve --workers N` (memory state: each process its own), driven from this process
by aiohttp at a fixed concurrency with non-streaming 16-token `/generate` requests for a fixed time. On this 2-core
machine the engines and this load generator share the cores with the gateway, so the scaling printed is a floor.

Final lines (machine-readable): `workers=N rps=… p50_ms=… p99_ms=… errors=…`, then `scaling=…` (rps with 2 / with 1).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from loadtests.engine.harness import EnginePair, free_port, start_pair
from loadtests.procstat import wait_ready

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 64


def _config(directory: Path, pairs: list[EnginePair]) -> tuple[Path, int]:
    port = free_port()
    document = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"name": "glm-5", "tokenizer": str(ROOT / "config/models/glm-5/tokenizer.json.gz"),
                    "chat_template": str(ROOT / "config/models/glm-5/chat_template.jinja"), "context_length": 8192,
                    "min_engine_version": "0.5.8"}],
    }
    model = document["models"][0]
    model["prefill"] = [{"url": p.prefill.url, "bootstrap_port": p.prefill.bootstrap_port} for p in pairs]
    model["decode"] = [{"url": p.decode.url} for p in pairs]
    model["routing"] = {"prefill_policy": "round_robin", "decode_policy": "round_robin"}
    document["logging"] = {"access_log": False}
    path = directory / f"workers-{port}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path, port


async def _drive(url: str, seconds: float) -> tuple[int, list[float], int]:
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds
    prompt = "Summarise the load-balancing policy in one sentence. " * 8

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        nonlocal errors
        n = 0
        while time.monotonic() < deadline:
            n += 1
            body = {"text": f"{index}-{n} {prompt}", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
            started = time.perf_counter()
            async with session.post(url + "/generate", json=body) as response:
                await response.read()
                if response.status != 200:
                    errors += 1
                    continue
            latencies.append(time.perf_counter() - started)

    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(session, i) for i in range(CONCURRENCY)))
    return len(latencies), latencies, errors


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="load per run (default 15)")
    args = parser.parse_args(argv)
    pairs = [start_pair(prefill_pool=200_000, decode_pool=200_000, context_length=8192, model="glm-5",
                        version="0.5.23", bug=False) for _ in range(2)]
    results: dict[int, float] = {}
    try:
        with tempfile.TemporaryDirectory() as directory:
            config, port = _config(Path(directory), pairs)
            url = f"http://127.0.0.1:{port}"
            for workers in (1, 2):
                process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                            "--workers", str(workers), "--log-level", "warning"], cwd=ROOT)
                try:
                    wait_ready(url, process, timeout_s=90)
                    asyncio.run(_drive(url, 2.0))  # warm-up: connections, token caches
                    done, latencies, errors = asyncio.run(_drive(url, args.seconds))
                finally:
                    process.terminate()
                    process.wait(timeout=60)
                rps = done / args.seconds
                results[workers] = rps
                print(f"workers={workers} rps={rps:.0f} p50_ms={_percentile(latencies, 0.5) * 1000:.1f} "
                      f"p99_ms={_percentile(latencies, 0.99) * 1000:.1f} errors={errors}", flush=True)
    finally:
        for pair in pairs:
            pair.stop()
    print(f"scaling={results[2] / results[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
