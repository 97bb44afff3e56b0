"""The HTTP edge alone, by server: `python -m loadtests.edge_bench [--granian-python PY]`.

Issue 25 step 4 chose how the generate routes are served; this measures the choices on the same trivial endpoint
(read the JSON body, answer a fixed ~600-byte JSON; no engines), so only the server layer differs: kvgate's edge
(`gateway.http.edge` on its guarded httptools protocol, as `kvgate serve` runs it), uvicorn with a raw ASGI app
(what the generate routes had before), and granian's RSGI (Rust HTTP, one worker, one runtime thread) when a Python
with granian is given. Each server is its own process; CPU is its utime + stime per request (all its threads) under
the same keep-alive load at c=64. Figure lines: `edge_<server>_cpu_ms_per_req=`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from typing import Any

from loadtests.engine.harness import free_port
from loadtests.procstat import REPO_ROOT, cpu_seconds, stop_process, wait_ready

ANSWER = (b'{"text":"' + b"lorem ipsum " * 40 + b'","meta_info":{"id":"kvg-0","prompt_tokens":91,'
          b'"completion_tokens":16,"finish_reason":{"type":"length","length":16}}}')
BODY = b'{"text":"' + b"Summarise the following customer note in two sentences. " * 6 + b'"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


class _TrivialEndpoint:
    """The edge's endpoint shape (`gateway.http.edge.EdgeEndpoint`): the body in, a fixed answer out."""

    async def serve(self, link: Any) -> None:
        more = True
        while more:
            _, more = await link.receive()
        await link.write_head(200, HEADERS)
        await link.write_body(ANSWER, more=False)


async def _asgi_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["path"] == "/healthz":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


class RsgiApp:
    """The same endpoint for granian's RSGI: `granian --interface rsgi loadtests.edge_bench:rsgi_app`."""

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.path == "/healthz":
            protocol.response_bytes(200, [], b"{}")
            return
        await protocol()
        protocol.response_bytes(200, [("content-type", "application/json")], ANSWER)


rsgi_app = RsgiApp()


def _serve(kind: str, port: int) -> None:
    import uvicorn

    from gateway.http.server import GuardedHttpToolsProtocol

    if kind == "edge":
        routes = {b"/generate": _TrivialEndpoint()}
        protocol = type("EdgeBenchProtocol", (GuardedHttpToolsProtocol,), {"edge_routes": routes})
    else:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as protocol  # type: ignore[assignment]
    config = uvicorn.Config(_asgi_app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            loop="uvloop", http=protocol, lifespan="on")
    uvicorn.Server(config).run()


async def _load(url: str, requests: int, concurrency: int) -> float:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                async with session.post(url + "/generate", data=BODY,
                                        headers={"content-type": "application/json"}) as response:
                    await response.read()
                    assert response.status == 200

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (granian serves from a worker process of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
        except OSError:
            continue
        todo.extend(children.get(current, []))
    return total


def _measure(command: list[str], requests: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    port = free_port()
    process = subprocess.Popen([*command, str(port)], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, process, timeout_s=30, path="/healthz")
        asyncio.run(_load(url, 500, 64))  # warm-up
        before = _tree_cpu_s(process.pid)
        elapsed = asyncio.run(_load(url, requests, 64))
        return (_tree_cpu_s(process.pid) - before) * 1000 / requests, requests / elapsed
    finally:
        stop_process(process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.edge_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--granian-python", help="a Python with granian installed")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve[0], int(args.serve[1]))
        return 0
    servers: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "kvgate_edge": ([sys.executable, "-m", "loadtests.edge_bench", "--serve", "edge"], None),
        "uvicorn_asgi": ([sys.executable, "-m", "loadtests.edge_bench", "--serve", "asgi"], None),
    }
    if args.granian_python:
        servers["granian_rsgi"] = ([args.granian_python, "-m", "granian", "--interface", "rsgi", "--workers", "1",
                                    "--runtime-threads", "1", "--no-ws", "--log-level", "warning",
                                    "loadtests.edge_bench:rsgi_app", "--port"],
                                   {**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    figures: dict[str, list[float]] = {name: [] for name in servers}
    for round_ in range(args.rounds):  # alternately, so the machine's drift falls on every server alike
        for name, (command, env) in servers.items():
            cpu_ms, rate = _measure(command, args.requests, env)
            figures[name].append(cpu_ms)
            print(f"round {round_ + 1} {name:<13} cpu_ms_per_req={cpu_ms:.3f} req_per_s={rate:.0f}", flush=True)
    for name, values in figures.items():
        print(f"edge_{name}_cpu_ms_per_req={sorted(values)[len(values) // 2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
